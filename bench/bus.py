"""Throughput of the bus runtime through one handler, against raw nats-py doing the same on the same server.

Prints events/s for publishing (runtime: Nats-Msg-Id and PubAck awaited; raw: the same headers
through nats-py's JetStream publish, 256 in flight each) and for consuming (runtime: a typed
handler, decode + validate + ack; raw: pull + ack, no decoding), plus the ratios. Each consumer is
timed from its first delivered message to its last, so connecting and provisioning count for
neither side; rounds are interleaved so drift in machine load hits both alike.
Run: .venv/bin/python bench/bus.py [--events N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import ConsumerConfig

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.events import PodIsolation, PodRef, encode
from kai_isolator.shared.settings import BusSettings

IN_FLIGHT = 256


def event(i: int) -> PodIsolation:
    return PodIsolation(
        pod=PodRef(namespace="bench", name=f"pod-{i}", uid=f"uid-{i}"), resource_version=str(i), state="running",
        node_name="gpu-node-1", container="main", injected=True, gpu_memory="4096", expected_limit="4147m",
    )


class Window:
    """First-to-last timing of a stream of deliveries."""

    def __init__(self) -> None:
        self.first = self.last = 0.0
        self.count = 0

    def tick(self) -> None:
        self.last = time.perf_counter()
        if not self.count:
            self.first = self.last
        self.count += 1

    def rate(self) -> float:
        return (self.count - 1) / (self.last - self.first) if self.count > 1 and self.last > self.first else 0.0


async def publish_with_runtime(url: str, settings: BusSettings, first: int, count: int) -> float:
    runtime = Runtime("bench-publisher", settings)
    await runtime.start(url)
    started = time.perf_counter()
    for start in range(first, first + count, IN_FLIGHT):
        await asyncio.gather(*(runtime.publish(event(i)) for i in range(start, min(first + count, start + IN_FLIGHT))))
    rate = count / (time.perf_counter() - started)
    await runtime.stop()
    return rate


async def publish_raw(url: str, first: int, count: int) -> float:
    nc = await nats.connect(url)
    js = nc.jetstream()
    payloads = [(e.subject(), encode(e, "bench"), e.dedup_id())
                for e in map(event, range(first, first + count))]  # encoded before the clock, as a caller would
    started = time.perf_counter()
    for start in range(0, count, IN_FLIGHT):
        await asyncio.gather(*(js.publish(s, data, headers={"Nats-Msg-Id": msg_id, "Content-Type": "application/cloudevents+json"})
                               for s, data, msg_id in payloads[start:start + IN_FLIGHT]))
    rate = count / (time.perf_counter() - started)
    await nc.drain()
    return rate


async def consume_with_runtime(url: str, settings: BusSettings, count: int, name: str) -> float:
    done = asyncio.Event()
    window = Window()

    async def handler(_: PodIsolation) -> None:
        window.tick()
        if window.count == count:
            done.set()

    runtime = Runtime("bench", settings)
    runtime.on_event(name, subjects.ALL_PODS, handler)
    await runtime.start(url)
    await done.wait()
    await runtime.stop()
    return window.rate()


async def consume_raw(url: str, count: int, name: str) -> float:
    nc = await nats.connect(url)
    js = nc.jetstream()
    psub = await js.pull_subscribe(subjects.ALL_PODS, durable=name, stream=subjects.STREAM_NAME, config=ConsumerConfig(max_deliver=5))
    window = Window()
    while window.count < count:
        for msg in await psub.fetch(64, timeout=2):
            await msg.ack()
            window.tick()
    await nc.drain()
    return window.rate()


async def main(count: int, rounds: int) -> None:
    results: dict[str, list[float]] = {"publish runtime": [], "publish raw": [], "consume runtime": [], "consume raw": []}
    with tempfile.TemporaryDirectory() as store:
        server = EmbeddedNats(Path(store))
        server.start()
        try:
            settings = BusSettings(nats_url=server.url)
            provision = Runtime("bench-provision", settings)  # the stream exists before anything is timed
            await provision.start(server.url)
            await provision.stop()
            for r in range(rounds):
                base = 2 * r * count  # new ids each run: the duplicate window must not swallow a publish
                results["publish runtime"].append(await publish_with_runtime(server.url, settings, base, count))
                results["publish raw"].append(await publish_raw(server.url, base + count, count))
                results["consume raw"].append(await consume_raw(server.url, count, f"raw-{r}"))
                results["consume runtime"].append(await consume_with_runtime(server.url, settings, count, f"runtime-{r}"))
        finally:
            server.stop()
    median = {k: statistics.median(v) for k, v in results.items()}
    print(f"events: {count} per run, {rounds} interleaved rounds (median), {IN_FLIGHT} publishes in flight")
    for name, rate in median.items():
        print(f"{name:<16} {rate:>10,.0f} events/s")
    print(f"ratio publish runtime/raw: {median['publish runtime'] / median['publish raw']:.2f}")
    print(f"ratio consume runtime/raw: {median['consume runtime'] / median['consume raw']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    asyncio.run(main(options.events, options.rounds))
