"""Benchmark the admission webhook against a bare aiohttp TLS endpoint, measured in the same run.

Both servers run in their own process on 127.0.0.1 with the same certificate; one client
process sends 10 KB AdmissionReviews of a GPU-sharing pod over TLS keep-alive connections
at 1 and 50 in flight and prints requests/s, p50 and p99, the server's own CPU time per request
(from /proc: the load client shares the cores, so req/s alone flatters whichever server is cheaper),
and the ratios ours / bare. The bare endpoint reads the same bodies and returns a fixed AdmissionReview.
Rounds are interleaved: every variant runs once per round, so drift in machine load hits them alike.

Two body sets: `ours` gets one workload's pods, bodies that differ only in request.uid, as a
controller creating a ReplicaSet's pods sends them (the webhook replays its verified answer);
`ours-distinct` gets 512 different pods of the same size (name and env values differ), so every
request is decided in full. With --with-nats a third server publishes every decision to an embedded
NATS; the cost of that per decision is its CPU per request minus ours', same run, and (less noisy) the
publisher measured alone in this process, interleaved rounds with and without the bus.
Goals (issue 15): server CPU per request <= 1.3x bare at 50 in flight; publishing <= 15 us of webhook
CPU per decision; p99 <= 0.8 ms at 1 in flight.

    .venv/bin/python bench/admission.py [--seconds 2.5] [--rounds 3] [--with-nats]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import orjson

BODY_BYTES = 10_000
FIXED_RESPONSE = orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                               "response": {"uid": "fixed", "allowed": True}})


def gpu_review(uid: str, name: str = "train-7f9c", value: str = "x" * 40) -> bytes:
    """A GPU-sharing pod padded with env to ~10 KB, in an AdmissionReview."""
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a", "labels": {"app": "train"},
                     "annotations": {"gpu-fraction": "0.5", "runai/shared-gpu-configmap": "train-abc1234-shared-gpu"}},
        "spec": {"schedulerName": "kai-scheduler", "nodeName": "gpu-node-1",
                 "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},  # a clean pod: no policy finding
                 "containers": [{"name": "app", "image": "registry.example.com/train:1.2.3", "env": []}]},
    }
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                          "resource": {"group": "", "version": "v1", "resource": "pods"}, "operation": "CREATE",
                          "namespace": "team-a", "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
                          "object": pod, "dryRun": False}}
    env = pod["spec"]["containers"][0]["env"]  # type: ignore[index]
    while len(body := orjson.dumps(review)) < BODY_BYTES:
        env.append({"name": f"VAR_{len(env):04d}", "value": value})
    return body


def distinct_reviews(count: int) -> list[bytes]:
    """`count` different GPU-sharing pods, each body its own (nothing to replay)."""
    return [gpu_review(str(uuid.uuid4()), name=f"train-{i:05d}", value=uuid.uuid4().hex + "x" * 8) for i in range(count)]


# --- servers (each runs in its own process) ---------------------------------------------


async def serve_bare(port: int, cert: str, key: str) -> None:
    from aiohttp import web

    async def mutate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=FIXED_RESPONSE, content_type="application/json")

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    app = web.Application(client_max_size=3 * 1024 * 1024)
    app.router.add_post("/mutate", mutate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    await asyncio.Event().wait()


async def serve_ours(port: int, cert: str, key: str, nats_url: str | None) -> None:
    from kai_isolator.services.admission.server import AdmissionServer
    from kai_isolator.services.admission.settings import AdmissionSettings
    from kai_isolator.shared.settings import BusSettings

    settings = AdmissionSettings(listen=f"127.0.0.1:{port}", tls_cert_file=Path(cert), tls_private_key_file=Path(key))
    server = AdmissionServer(settings, BusSettings(nats_url=nats_url) if nats_url else None)
    await server.start()
    await asyncio.Event().wait()


# --- client ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(url: str, context: ssl.SSLContext, bodies: list[bytes], in_flight: int, seconds: float,
                  server_pid: int) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=in_flight, ssl=context)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        async def one(body: bytes) -> int:
            async with session.post(url, data=body) as response:
                await response.read()
                return response.status

        await asyncio.gather(*(one(bodies[i % len(bodies)]) for i in range(in_flight * 4)))  # handshakes + warm-up
        deadline = time.perf_counter() + seconds
        counter = 0

        async def worker() -> None:
            nonlocal errors, counter
            while time.perf_counter() < deadline:
                counter += 1
                started = time.perf_counter()
                if await one(bodies[counter % len(bodies)]) != 200:
                    errors += 1
                latencies.append(time.perf_counter() - started)

        started, cpu_before = time.perf_counter(), cpu_seconds(server_pid)
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        elapsed, cpu = time.perf_counter() - started, cpu_seconds(server_pid) - cpu_before
    latencies.sort()
    quantile = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000  # noqa: E731
    return {"rps": len(latencies) / elapsed, "p50": quantile(0.50), "p99": quantile(0.99), "errors": errors,
            "cpu_us": cpu / max(1, len(latencies)) * 1e6}


def start(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_up(url: str, context: ssl.SSLContext, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
        while True:
            try:
                async with session.post(url, data=gpu_review("probe"), headers={"Content-Type": "application/json"}) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start: {process.stderr.read().decode() if process.stderr else ''}")
            await asyncio.sleep(0.1)


async def main(seconds: float, rounds: int, with_nats: bool) -> None:
    from kai_isolator.services.admission.certs import issue

    workdir = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    ca, cert, key = issue(["127.0.0.1"]).write(workdir)
    context = ssl.create_default_context(cafile=str(ca))
    workload = [gpu_review(str(uuid.uuid4())) for _ in range(512)]
    distinct = distinct_reviews(512)
    nats = None
    servers: dict[str, list[str]] = {}
    bare_port, ours_port = free_port(), free_port()
    servers["bare"] = ["--serve", "bare", "--port", str(bare_port), "--cert", str(cert), "--key", str(key)]
    servers["ours"] = ["--serve", "ours", "--port", str(ours_port), "--cert", str(cert), "--key", str(key)]
    if with_nats:
        from kai_isolator.shared.embedded_nats import EmbeddedNats
        nats = EmbeddedNats(workdir / "nats")
        nats.start()
        servers["ours+nats"] = ["--serve", "ours", "--port", str(free_port()), "--cert", str(cert), "--key", str(key), "--nats-url", nats.url]
    # variant -> (server, bodies)
    variants = {"bare": ("bare", workload), "ours": ("ours", workload), "ours-distinct": ("ours", distinct)}
    if with_nats:
        variants["ours+nats"] = ("ours+nats", workload)
    processes = {name: start(argv) for name, argv in servers.items()}
    urls = {name: f"https://127.0.0.1:{argv[argv.index('--port') + 1]}/mutate" for name, argv in servers.items()}
    try:
        for name, process in processes.items():
            await wait_up(urls[name], context, process)
        print(f"admission webhook benchmark: {len(workload[0])}-byte AdmissionReviews, TLS keep-alive, {seconds:g} s per run, "
              f"{rounds} round(s), cpus={os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        for _ in range(rounds):
            for in_flight in (1, 50):
                for name, (server, bodies) in variants.items():  # interleaved, so drift in machine load hits every variant alike
                    results.setdefault((name, in_flight), []).append(
                        await measure(urls[server], context, bodies, in_flight, seconds, processes[server].pid))
        report(summarise(results), list(variants))
        if nats is not None:
            await publisher_cost(nats.url, rounds)
        print(f"load average at the end: {os.getloadavg()[0]:.1f} (other work on the cores inflates every CPU figure alike)")
    finally:
        for process in processes.values():
            process.terminate()
            process.wait()
        if nats is not None:
            nats.stop()


async def publisher_cost(url: str, rounds: int, decisions: int = 20_000) -> None:
    """The publisher alone, in this process: CPU per decision offered in bursts of 25 and published
    to NATS, minus the same offers with no bus; interleaved rounds, without the HTTP side's noise."""
    from prometheus_client import CollectorRegistry

    from kai_isolator.services.admission.answer import DecisionRecord
    from kai_isolator.services.admission.publisher import DecisionPublisher
    from kai_isolator.services.admission.server import Metrics
    from kai_isolator.shared.bus import Runtime
    from kai_isolator.shared.settings import BusSettings

    async def one_round(runtime: Runtime | None, tag: str) -> float:
        metrics = Metrics(CollectorRegistry(), lambda: 0)
        publisher = DecisionPublisher(runtime, metrics.publishing, decisions, 256)
        publisher.start()
        publisher.bus_ready.set()
        await asyncio.sleep(0.1)
        started = time.process_time()
        for i in range(decisions):
            publisher.offer(DecisionRecord(f"{tag}-{i}", "team-a", "train-7f9c", "injected", "libvgpu injected into containers[0]", "app", (), 9))
            if i % 25 == 24:
                await asyncio.sleep(0.002)
        while publisher.pending:
            await asyncio.sleep(0.002)
        spent = time.process_time() - started
        await publisher.stop()
        return spent / decisions * 1e6

    runtime = Runtime("admission", BusSettings(nats_url=url))
    await runtime.start(url)
    try:
        without, with_bus = [], []
        for r in range(rounds):
            without.append(await one_round(None, f"none-{r}-{uuid.uuid4()}"))
            with_bus.append(await one_round(runtime, f"bus-{r}-{uuid.uuid4()}"))
    finally:
        await runtime.stop()
    print(f"publisher alone: {statistics.median(with_bus) - statistics.median(without):.1f} us of CPU per decision published "
          f"(median of {rounds} rounds; best {min(with_bus) - min(without):.1f}; goal <= 15 us)")


def summarise(results: dict[tuple[str, int], list[dict[str, float]]]) -> dict[tuple[str, int], dict[str, float]]:
    """The median of every figure over the rounds, printed as a table."""
    print(f"{'variant':<14} {'in flight':>9} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'CPU us/req':>11} {'(rounds)':>16}")
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for (name, in_flight), runs in results.items():
        best = {k: statistics.median(r[k] for r in runs) for k in ("rps", "p50", "p99", "errors", "cpu_us")}
        summary[(name, in_flight)] = best
        spread = f"{min(r['cpu_us'] for r in runs):.0f}-{max(r['cpu_us'] for r in runs):.0f}"
        print(f"{name:<14} {in_flight:>9} {best['rps']:>9.0f} {best['p50']:>8.3f} {best['p99']:>8.3f} {best['errors']:>7.0f} "
              f"{best['cpu_us']:>11.1f} {spread:>16}")
    return summary


def report(summary: dict[tuple[str, int], dict[str, float]], variants: list[str]) -> None:
    """Ratios to bare and the goals, from the same run."""
    for in_flight in (1, 50):
        bare = summary[("bare", in_flight)]
        for name in variants:
            if name != "bare":
                ours = summary[(name, in_flight)]
                print(f"ratio {name}/bare at {in_flight:>2} in flight: {ours['rps'] / bare['rps']:.2f}x req/s, "
                      f"{ours['cpu_us'] / bare['cpu_us']:.2f}x server CPU per request (goal at 50: <= 1.3x)")
    if "ours+nats" in variants:
        for in_flight in (1, 50):
            cost = summary[("ours+nats", in_flight)]["cpu_us"] - summary[("ours", in_flight)]["cpu_us"]
            print(f"publishing to NATS at {in_flight:>2} in flight: {cost:.1f} us of webhook CPU per decision (goal <= 15 us)")
    for name in ("ours", "ours-distinct"):
        print(f"p99 {name} at 1 in flight: {summary[(name, 1)]['p99']:.3f} ms (goal <= 0.8 ms)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.5, help="measured seconds per run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is printed")
    parser.add_argument("--with-nats", action="store_true", help="also run the webhook publishing to an embedded NATS")
    parser.add_argument("--serve", choices=["bare", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cert", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.serve == "bare":
        asyncio.run(serve_bare(options.port, options.cert, options.key))
    elif options.serve == "ours":
        asyncio.run(serve_ours(options.port, options.cert, options.key, options.nats_url))
    else:
        asyncio.run(main(options.seconds, options.rounds, options.with_nats))
