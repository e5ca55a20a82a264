"""Pod watcher throughput, CPU, memory and latency on a real etcd + kube-apiserver, events acked into JetStream.

Burst, per round and pod count N: N GPU-sharing pods are created while the watcher is stopped
(the API server's create rate is not what is measured), then the watcher process starts from its
saved resume point; events/s is counted from the first to the last of the 2N events on the
stream, CPU from the watcher's /proc times over the same span. Baseline, interleaved with the
watcher rounds: the same bus work strictly sequentially (per pod one KV create of the watcher's
own record bytes, then its two events with the same headers, each awaited), same N. Paced: pods
created one at a time at --rate while the watcher runs: change (the ADDED
the bench's own watch gets) -> event on the stream, and from the create request.
Run: .venv/bin/python bench/watcher.py [--pods 5000 20000] [--rounds 2] [--paced 200 --rate 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import orjson
from nats.js.api import DeliverPolicy

from kai_isolator.services.watcher.kube import KubeClient, load_endpoint
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.services.watcher.story import advance, view_of
from kai_isolator.shared import subjects
from kai_isolator.shared.bus import provision_stream
from kai_isolator.shared.embedded_nats import EmbeddedNats, free_port
from kai_isolator.shared.events import encode
from kai_isolator.shared.lease import LEASE_BUCKET
from kai_isolator.shared.settings import BusSettings

try:
    from kai_isolator.services.devcluster.build import ensure_all
    from kai_isolator.services.devcluster.plane import ControlPlane
except ImportError:  # before the control plane moved into the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from control_plane.build import ensure_all  # type: ignore[no-redef]
    from control_plane.cluster import ControlPlane  # type: ignore[no-redef]

EVENTS_PER_POD = 2  # admitted + isolation-missing: no scheduler, no webhook, so no node and no injection
CREATORS = 48  # concurrent creates: the API server's own rate, outside every timed region


def gpu_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": {"gpu-memory": "4096"}},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}


def proc_stat(pid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MiB) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return cpu, rss


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class Arrivals:
    """Every pod event reaching the stream's subjects (a core subscription), with the watcher's CPU at the first."""

    pid: int = 0
    count: int = 0
    first_at: float = 0.0
    last_at: float = 0.0
    cpu_at_first: float = 0.0
    first: dict[str, float] = field(default_factory=dict)

    def reset(self, pid: int) -> None:
        self.pid, self.count, self.first_at, self.last_at = pid, 0, 0.0, 0.0
        self.first.clear()

    async def on_message(self, msg: Any) -> None:
        now = time.perf_counter()
        if self.count == 0:
            self.first_at = now
            self.cpu_at_first = proc_stat(self.pid)[0] if self.pid else 0.0
        self.count += 1
        self.last_at = now
        self.first.setdefault(msg.subject, now)


async def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: timed out waiting for {what}")
        await asyncio.sleep(0.005)


class BenchPlane(ControlPlane):  # type: ignore[misc, valid-type]
    """The control plane without the API server's 5-minute etcd compaction: a round's resume point must outlive the next round's creates."""

    def apiserver_args(self) -> list[str]:
        return [*super().apiserver_args(), "--etcd-compaction-interval=0"]


class Api:
    """The admin's REST calls on the real API server, many in flight."""

    def __init__(self, plane: Any) -> None:
        context = ssl.create_default_context(cafile=str(plane.workdir / "ca.crt"))
        context.load_cert_chain(str(plane.workdir / "admin.crt"), str(plane.workdir / "admin.key"))
        self.url = plane.url
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=CREATORS))

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.url + path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as answer:
            data = await answer.read()
            if answer.status >= 300:
                raise SystemExit(f"bench: POST {path}: {answer.status} {data[:300]!r}")
            return dict(orjson.loads(data))

    async def namespace(self, name: str) -> None:
        await self.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        # What the controller-manager (absent here) would create: pods need their namespace's default ServiceAccount.
        await self.post(f"/api/v1/namespaces/{name}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})

    async def create_pods(self, namespace: str, names: list[str]) -> list[dict[str, Any]]:
        queue = list(reversed(names))
        created: list[dict[str, Any]] = []

        async def creator() -> None:
            while queue:
                created.append(await self.post(f"/api/v1/namespaces/{namespace}/pods", gpu_pod(queue.pop())))

        await asyncio.gather(*(creator() for _ in range(CREATORS)))
        return created


# CPU time, not wall time: on two shared cores a wall-clock profile charges other processes' turns to whatever ran.
PROFILED = """
import cProfile, runpy, sys, time
profile = cProfile.Profile(time.process_time)
sys.argv[0] = "watcher"
profile.enable()
try:
    runpy.run_module("kai_isolator.services.watcher", run_name="__main__")
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats("{path}")
"""


class Watcher:
    """The watcher as its own process (`python -m kai_isolator.services.watcher`), so its CPU and RSS are its own."""

    def __init__(self, kubeconfig: Path, nats_url: str, log: Path, profile: Path | None = None) -> None:
        self.profile = profile
        self.probe_port = free_port()
        self.args = ["--kubeconfig", str(kubeconfig), "--probe-listen", f"127.0.0.1:{self.probe_port}"]
        self.env = {**os.environ, "KAI_ISOLATOR_NATS_URL": nats_url, "KAI_ISOLATOR_LOG_LEVEL": "warning"}
        self.log = log
        self.process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.starts = getattr(self, "starts", 0) + 1
            command = ["-c", PROFILED.format(path=f"{self.profile}.{self.starts}")] if self.profile else ["-m", "kai_isolator.services.watcher"]
            self.process = await asyncio.create_subprocess_exec(sys.executable, *command, *self.args,
                                                                env=self.env, stdout=out, stderr=out)

    async def metric(self, name: str) -> float:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{self.probe_port}/metrics") as answer:
            text = await answer.text()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{"))

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)  # graceful: the resume point is saved
            await self.process.wait()


@dataclass
class Burst:
    pods: int
    rate: float
    cpu_us: float
    rss_after: float
    startup_s: float
    relists: float


async def watcher_burst(api: Api, watcher: Watcher, arrivals: Arrivals, js: Any, namespace: str, pods: int) -> Burst:
    await watcher.stop()
    await js.purge_stream(f"KV_{WatcherSettings().state_bucket}")  # each round tracks its own N pods only
    await api.namespace(namespace)
    await api.create_pods(namespace, [f"p-{i}" for i in range(pods)])
    spawned = time.perf_counter()
    await watcher.start()
    arrivals.reset(watcher.pid)
    try:
        await wait_for(lambda: arrivals.count >= pods * EVENTS_PER_POD, 600, f"{pods * EVENTS_PER_POD} events")
    except SystemExit:
        tail = watcher.log.read_text(errors="replace").splitlines()[-20:]
        print(f"bench: {arrivals.count} of {pods * EVENTS_PER_POD} events; the watcher's log ends:", *tail, sep="\n", file=sys.stderr)
        raise
    cpu = proc_stat(watcher.pid)[0] - arrivals.cpu_at_first
    await asyncio.sleep(1.0)
    rss_after = proc_stat(watcher.pid)[1]
    relists = await watcher.metric("kai_isolator_watcher_relists_total")  # 0: it resumed from its saved point, as meant
    span = arrivals.last_at - arrivals.first_at
    return Burst(pods, (arrivals.count - 1) / span, cpu / (arrivals.count - 1) * 1e6, rss_after, arrivals.first_at - spawned, relists)


async def baseline(nats_url: str, sample: dict[str, Any], pods: int, round_no: int) -> float:
    """Events/s of the watcher's bus work strictly one pod after the other: its record bytes and event bytes, awaited one by one."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    kv = await js.key_value(WatcherSettings().state_bucket)
    view = view_of(sample)
    assert view is not None
    events, record = advance(view, None, None)
    value = record.model_dump_json().encode()
    datas = [encode(e, "watcher") for e in events]
    started = time.perf_counter()
    for i in range(pods):
        uid = f"baseline-{round_no}-{pods}-{i}"
        await kv.create(f"all.{uid}", value)
        seq = 0
        for n, data in enumerate(datas):
            subject = subjects.pod(f"baseline-{round_no}-{pods}", f"p-{i}")
            headers = {"Nats-Msg-Id": f"pod:{uid}:{n}", "Content-Type": "application/cloudevents+json",
                       "Nats-Expected-Last-Subject-Sequence": str(seq)}
            seq = (await js.publish(subject, data, headers=headers)).seq
    rate = pods * len(datas) / (time.perf_counter() - started)
    await nc.close()
    return rate


async def observe(client: KubeClient, namespace: str, seen: dict[str, float]) -> None:
    """The bench's own watch on the paced namespace: when the API server hands each pod's ADDED out (the change)."""
    timeout = aiohttp.ClientTimeout(sock_read=120)
    async for event in client.watch(f"/api/v1/namespaces/{namespace}/pods", {"resourceVersion": "0"}, timeout):
        if event.get("type") == "ADDED":
            seen.setdefault(event["object"]["metadata"]["name"], time.perf_counter())


async def paced(api: Api, client: KubeClient, arrivals: Arrivals, namespace: str, count: int, rate: float) -> tuple[list[float], list[float]]:
    """(change seen on a watch -> event on the stream, create sent -> event on the stream), per pod."""
    await api.namespace(namespace)
    seen: dict[str, float] = {}
    observer = asyncio.create_task(observe(client, namespace, seen))
    await asyncio.sleep(0.5)
    sent: dict[str, float] = {}
    for i in range(count):
        name = f"p-{i}"
        sent[name] = time.perf_counter()
        await api.post(f"/api/v1/namespaces/{namespace}/pods", gpu_pod(name))
        await asyncio.sleep(1 / rate)
    subject = {n: subjects.pod(namespace, n) for n in sent}
    await wait_for(lambda: all(s in arrivals.first for s in subject.values()) and len(seen) >= count, 60, "the paced pods' events")
    observer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await observer
    return [arrivals.first[subject[n]] - seen[n] for n in sent], [arrivals.first[subject[n]] - sent[n] for n in sent]


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-watcher-") as tmp:
        work = Path(tmp)
        server = EmbeddedNats(work / "js")
        server.start()
        plane = BenchPlane(ensure_all(sys.stderr), work / "plane").start()
        api = Api(plane)
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await provision_stream(js, BusSettings(nats_url=server.url))
        arrivals = Arrivals()
        # A JetStream ordered consumer, not a core subscription: it hands out what the stream stored, once each
        # (a core subscriber would also see publishes the stream refused as duplicates or fenced).
        await js.subscribe(subjects.ALL_PODS, cb=arrivals.on_message, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW,
                           pending_msgs_limit=-1, pending_bytes_limit=-1)
        watcher = Watcher(plane.admin_kubeconfig, server.url, work / "watcher.log", args.profile)
        bursts: list[Burst] = []
        baselines: dict[int, list[float]] = {}
        try:
            await api.namespace("warm-up")
            sample = (await api.create_pods("warm-up", ["w-0"]))[0]
            await watcher.start()  # the first start lists, provisions the buckets and saves a resume point
            arrivals.reset(watcher.pid)
            await wait_for(lambda: arrivals.count >= EVENTS_PER_POD, 60, "the warm-up pod's events")
            await asyncio.sleep(2.5)  # past the resume save interval
            warm_rss = proc_stat(watcher.pid)[1]  # idle, one pod tracked: the reference for the per-pod figure
            for round_no in range(args.rounds):
                for pods in args.pods:
                    baselines.setdefault(pods, []).append(await baseline(server.url, sample, pods, round_no))
                    bursts.append(await watcher_burst(api, watcher, arrivals, js, f"burst-{round_no}-{pods}", pods))
                    print(f"  round {round_no + 1}, {pods} pods: watcher {bursts[-1].rate:.0f} events/s, baseline {baselines[pods][-1]:.0f}",
                          file=sys.stderr, flush=True)
            await asyncio.sleep(1.0)
            cpu_idle, rss_idle = proc_stat(watcher.pid)
            await asyncio.sleep(5.0)
            idle_cpu_share = (proc_stat(watcher.pid)[0] - cpu_idle) / 5.0
            client = KubeClient(load_endpoint(plane.admin_kubeconfig))
            paced_lat, create_lat = await paced(api, client, arrivals, "paced", args.paced, args.rate)
            await client.close()
            rss_tracked = proc_stat(watcher.pid)[1]
        finally:
            await watcher.stop()
            await api.session.close()
            await nc.close()
            plane.stop()
            server.stop()

    ms = 1000
    print(f"watcher bench: real kube-apiserver {plane.binaries.kube_version}, {args.rounds} interleaved rounds; events/s into JetStream")
    for pods in args.pods:
        mine = [b for b in bursts if b.pods == pods]
        for n, (b, base) in enumerate(zip(mine, baselines[pods], strict=True)):
            print(f"  {pods:6d} pods, round {n + 1}: watcher {b.rate:8.0f} events/s   sequential baseline {base:7.0f}   ratio {b.rate / base:5.2f}"
                  f"   CPU {b.cpu_us:5.0f} us/event   {(b.rss_after - warm_rss) * 1024 / pods:4.2f} KiB/pod tracked"
                  f"   (start to first event {b.startup_s:.2f} s, relists {b.relists:.0f})")
    print(f"  idle RSS (one pod tracked): {warm_rss:.1f} MiB; KiB/pod = (RSS after the burst - that) / N, transient buffers included")
    print(f"  idle watcher after the bursts ({bursts[-1].pods} pods tracked): RSS {rss_idle:.1f} MiB, CPU {idle_cpu_share * 100:.2f}% of a core")
    print(f"  paced ({args.paced} pods at {args.rate:g}/s) change (ADDED on a watch) -> event on the stream: p50 {percentile(paced_lat, .5) * ms:5.2f} ms"
          f"   p99 {percentile(paced_lat, .99) * ms:5.2f} ms   (from the create request: p50 {percentile(create_lat, .5) * ms:5.2f} ms,"
          f" p99 {percentile(create_lat, .99) * ms:5.2f} ms)")
    print(f"  RSS after the paced pods: {rss_tracked:.1f} MiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, nargs="+", default=[5000, 20000], help="pods per burst (default 5000 20000)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of baseline and watcher (default 2)")
    parser.add_argument("--paced", type=int, default=200, help="pods created one by one afterwards (default 200)")
    parser.add_argument("--rate", type=float, default=50.0, help="pods per second in the paced phase (default 50)")
    parser.add_argument("--profile", type=Path, help="run the watcher under cProfile, one PATH.<n> per start (read with pstats)")
    asyncio.run(main(parser.parse_args()))
