"""The `pod_events` fixture: a durable consumer of isolator.pod.> that keeps every event it is handed,
in order, acked (import it into a conftest to use it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import provision_stream
from kai_isolator.shared.events import PodIsolation, decode
from kai_isolator.shared.settings import BusSettings


class PodEvents:
    """Every isolator.pod.> event the consumer was handed, in order."""

    def __init__(self) -> None:
        self.received: list[PodIsolation] = []

    def states(self, name: str, namespace: str | None = None) -> list[str]:
        return [e.state for e in self.received if e.pod.name == name and namespace in (None, e.pod.namespace)]

    def count(self) -> int:
        return len(self.received)


@pytest.fixture
async def pod_events(bus_settings: BusSettings) -> AsyncIterator[PodEvents]:
    nc = await nats.connect(bus_settings.nats_url or "", max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream()
    await provision_stream(js, bus_settings)
    events = PodEvents()
    config = ConsumerConfig(durable_name="test-pod-events", ack_policy=AckPolicy.EXPLICIT, filter_subject=subjects.ALL_PODS)
    psub = await js.pull_subscribe(subjects.ALL_PODS, durable="test-pod-events", stream=subjects.STREAM_NAME, config=config)
    stop = asyncio.Event()

    async def pump() -> None:
        while not stop.is_set():
            try:
                batch = await psub.fetch(256, timeout=0.3)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error:  # NATS away (a crash test): try again
                await asyncio.sleep(0.1)
                continue
            for msg in batch:
                _, payload = decode(msg.data)
                assert isinstance(payload, PodIsolation)
                events.received.append(payload)
                with contextlib.suppress(nats.errors.Error):
                    await msg.ack()

    task = asyncio.create_task(pump())
    yield events
    stop.set()
    await task
    with contextlib.suppress(Exception):
        await nc.close()
