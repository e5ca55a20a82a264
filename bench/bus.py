"""Throughput of the bus runtime through one handler, against raw nats-py doing the same on the same server.

Prints events/s for: publish (runtime, with Nats-Msg-Id and PubAck), consume through a typed
handler (decode + validate + ack), and the raw baseline (pull + ack, no decoding), plus ratios.
Run: .venv/bin/python bench/bus.py [--events N]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import ConsumerConfig

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.events import PodIsolation, PodRef
from kai_isolator.shared.settings import BusSettings


def event(i: int) -> PodIsolation:
    return PodIsolation(
        pod=PodRef(namespace="bench", name=f"pod-{i}", uid=f"uid-{i}"), resource_version=str(i), state="running",
        node_name="gpu-node-1", container="main", injected=True, gpu_memory="4096", expected_limit="4147m",
    )


async def publish_all(runtime: Runtime, count: int) -> float:
    started = time.perf_counter()
    for start in range(0, count, 256):
        await asyncio.gather(*(runtime.publish(event(i)) for i in range(start, min(count, start + 256))))
    return count / (time.perf_counter() - started)


async def consume_with_runtime(url: str, settings: BusSettings, count: int) -> float:
    done = asyncio.Event()
    seen = 0

    async def handler(_: PodIsolation) -> None:
        nonlocal seen
        seen += 1
        if seen == count:
            done.set()

    runtime = Runtime("bench", settings)
    runtime.on_event("pods", subjects.ALL_PODS, handler)
    started = time.perf_counter()
    await runtime.start(url)
    await done.wait()
    rate = count / (time.perf_counter() - started)
    await runtime.stop()
    return rate


async def consume_raw(url: str, count: int) -> float:
    nc = await nats.connect(url)
    js = nc.jetstream()
    started = time.perf_counter()
    psub = await js.pull_subscribe(subjects.ALL_PODS, durable="raw", stream=subjects.STREAM_NAME, config=ConsumerConfig(max_deliver=5))
    seen = 0
    while seen < count:
        for msg in await psub.fetch(64, timeout=2):
            await msg.ack()
            seen += 1
    rate = count / (time.perf_counter() - started)
    await nc.drain()
    return rate


async def main(count: int) -> None:
    with tempfile.TemporaryDirectory() as store:
        server = EmbeddedNats(Path(store))
        server.start()
        try:
            settings = BusSettings(nats_url=server.url)
            publisher = Runtime("bench-publisher", settings)
            await publisher.start(server.url)
            publish_rate = await publish_all(publisher, count)
            await publisher.stop()
            raw_rate = await consume_raw(server.url, count)
            runtime_rate = await consume_with_runtime(server.url, settings, count)
        finally:
            server.stop()
    print(f"events: {count}")
    print(f"publish via runtime (PubAck awaited, 256 in flight): {publish_rate:,.0f} events/s")
    print(f"raw nats-py pull+ack baseline:                      {raw_rate:,.0f} events/s")
    print(f"runtime typed handler (decode+validate+ack):        {runtime_rate:,.0f} events/s")
    print(f"ratio runtime/raw: {runtime_rate / raw_rate:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=20000)
    asyncio.run(main(parser.parse_args().events))
