"""Pod watcher throughput and latency: N GPU-sharing pods created in the sandbox API, their events on JetStream.

The watcher runs as its own process (`kai-isolator watcher`, real kubernetes-asyncio against
the sandbox), so its RSS is its own. Prints: events/s reaching JetStream for a burst of N pod
creations, p50/p99 latency from pod change (sandbox commit) to the event on the bus, both for
the burst (includes queueing) and for a paced trickle (unloaded), the watcher's RSS, and the
ratio to a baseline measured in the same run: sequential acked JetStream publishes with a KV
put per pod, which is the bus work the watcher does per pod without any Kubernetes work.
Run: .venv/bin/python bench/watcher.py [--pods 5000] [--paced 200 --rate 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import KeyValueConfig

from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.sandbox.settings import SandboxSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.bus import provision_stream
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.events import PodIsolation, PodRef, encode
from kai_isolator.shared.settings import BusSettings

EVENTS_PER_POD = 2  # admitted + isolation-missing: the bench pods carry no injection


def gpu_pod(name: str) -> dict:
    return {"metadata": {"name": name, "annotations": {"gpu-memory": "4096"}}, "spec": {"containers": [{"name": "main", "image": "busybox"}]}}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Arrivals:
    """Time each pod's first event reaches the bus (core subscription on the stream's subjects)."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.count = 0
        self.last_at = 0.0

    async def on_message(self, msg: nats.aio.msg.Msg) -> None:
        now = time.perf_counter()
        self.count += 1
        self.last_at = now
        name = msg.subject.rsplit(".", 1)[-1]
        self.first.setdefault(name, now)


async def wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("bench: timed out waiting for the watcher")
        await asyncio.sleep(0.01)


async def baseline(url: str, pods: int) -> float:
    """Events/s of the watcher's bus work alone: per pod one KV put then two acked publishes, sequentially."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="bench-baseline", history=1))
    started = time.perf_counter()
    for i in range(pods):
        await kv.put(f"all.uid-{i}", b"{" + b"x" * 400 + b"}")
        for state in ("admitted", "isolation-missing"):
            event = PodIsolation(pod=PodRef(namespace="baseline", name=f"b-{i}", uid=f"uid-{i}"), resource_version=str(i), state=state, gpu_memory="4096")
            await js.publish(event.subject(), encode(event, "bench"), headers={"Nats-Msg-Id": event.dedup_id()})
    rate = pods * EVENTS_PER_POD / (time.perf_counter() - started)
    await nc.close()
    return rate


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-watcher-") as tmp:
        work = Path(tmp)
        server = EmbeddedNats(work / "js")
        server.start()
        settings = BusSettings(nats_url=server.url)
        nc = await nats.connect(server.url)
        await provision_stream(nc.jetstream(), settings)
        arrivals = Arrivals()
        await nc.subscribe(subjects.ALL_PODS, cb=arrivals.on_message)
        sandbox = SandboxApi(SandboxSettings(kubeconfig=work / "kubeconfig", bookmark_interval_s=1.0, retained_events=args.pods * 4 + 1000))
        await sandbox.start()
        env = {**os.environ, "KAI_ISOLATOR_NATS_URL": server.url, "KAI_ISOLATOR_LOG_LEVEL": "warning"}
        watcher = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kai_isolator.services.cli", "watcher", "--kubeconfig", str(work / "kubeconfig"), "--probe-listen", "127.0.0.1:0", env=env,
        )
        try:
            await sandbox.create("pods", gpu_pod("warm-up"), "default")
            await wait_for(lambda: "warm-up" in arrivals.first, 60)
            rss_idle = rss_mib(watcher.pid)

            # Burst: every pod at once; events/s is what the watcher sustains, latency includes the queue.
            arrivals.count = 0
            created: dict[str, float] = {}
            started = time.perf_counter()
            for i in range(args.pods):
                name = f"burst-{i}"
                await sandbox.create("pods", gpu_pod(name), "default")
                created[name] = time.perf_counter()
                if i % 100 == 99:
                    await asyncio.sleep(0)
            await wait_for(lambda: arrivals.count >= args.pods * EVENTS_PER_POD, 600)
            burst_rate = arrivals.count / (arrivals.last_at - started)
            burst_lat = [arrivals.first[n] - t for n, t in created.items()]
            rss_after = rss_mib(watcher.pid)

            # Paced: a trickle, so latency is the path itself (watch -> watcher -> KV -> JetStream).
            paced: dict[str, float] = {}
            for i in range(args.paced):
                name = f"paced-{i}"
                await sandbox.create("pods", gpu_pod(name), "default")
                paced[name] = time.perf_counter()
                await asyncio.sleep(1 / args.rate)
            await wait_for(lambda: all(n in arrivals.first for n in paced), 120)
            paced_lat = [arrivals.first[n] - t for n, t in paced.items()]
        finally:
            watcher.send_signal(signal.SIGTERM)
            await watcher.wait()
            await sandbox.stop()
        base = await baseline(server.url, min(args.pods, 2000))
        await nc.close()
        server.stop()

    ms = 1000
    print(f"watcher bench: {args.pods} GPU-sharing pods created in one burst, {args.pods * EVENTS_PER_POD} events")
    print(f"  events/s reaching JetStream (burst):        {burst_rate:10.0f}")
    print(f"  baseline events/s (same bus work, no k8s):  {base:10.0f}   ratio watcher/baseline = {burst_rate / base:.2f}")
    print(f"  pod change -> bus latency, burst:   p50 {percentile(burst_lat, .5) * ms:8.1f} ms   p99 {percentile(burst_lat, .99) * ms:8.1f} ms (includes the backlog)")
    print(f"  pod change -> bus latency, paced ({args.paced} pods at {args.rate}/s): p50 {percentile(paced_lat, .5) * ms:6.1f} ms   p99 {percentile(paced_lat, .99) * ms:6.1f} ms")
    print(f"  watcher RSS: {rss_idle:.1f} MiB idle, {rss_after:.1f} MiB after {args.pods} pods tracked")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=5000, help="pods created in the burst (default 5000)")
    parser.add_argument("--paced", type=int, default=200, help="pods created one by one afterwards (default 200)")
    parser.add_argument("--rate", type=float, default=50.0, help="pods per second in the paced phase (default 50)")
    asyncio.run(main(parser.parse_args()))
