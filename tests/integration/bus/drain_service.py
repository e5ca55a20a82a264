"""A tiny service for the SIGTERM test: slow handler, records what it handled, runs until signalled."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.events import HealthVerdict, PodIsolation
from kai_isolator.shared.settings import BusSettings


async def main(url: str, journal: Path) -> None:
    async def slow(event: PodIsolation) -> HealthVerdict:
        with journal.open("a") as out:
            out.write(f"start {event.pod.name}\n")
        await asyncio.sleep(0.5)
        with journal.open("a") as out:
            out.write(f"done {event.pod.name}\n")
        return HealthVerdict(pod=event.pod, node_name="n", container="c", verdict="verified", observation=event.pod.name)

    runtime = Runtime("drainer", BusSettings(nats_url=url, ack_wait_s=30))
    runtime.on_event("pods", subjects.ALL_PODS, slow)
    await runtime.run(url)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
