"""The bus and its events as the tests drive them: starting runtimes (`RuntimeFactory`, the root conftest's
`start_runtime`), publishing through an outage, the pod events the tests publish, and the `pod_events` fixture, a
durable consumer of isolator.pod.> that keeps every event it is handed, in order, acked (import it into a conftest)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime, provision_stream
from kai_isolator.shared.errors import BusError
from kai_isolator.shared.events import Payload, PodIsolation, PodRef, decode
from kai_isolator.shared.settings import BusSettings

RuntimeFactory = Callable[..., Awaitable[Runtime]]


async def publish_until_stored(runtime: Runtime, event: Payload) -> None:
    """At-least-once publishing through an outage; the Nats-Msg-Id makes a retry harmless."""
    while True:
        try:
            await runtime.publish(event)
            return
        except BusError:
            await asyncio.sleep(0.1)


def pod_event(name: str, *, namespace: str = "team-a", resource_version: str = "1", state: str = "running",
              **fields: object) -> PodIsolation:
    """The watcher's event of pod `name` (uid `uid-<name>`); `fields` set the rest of PodIsolation."""
    return PodIsolation(pod=PodRef(namespace=namespace, name=name, uid=f"uid-{name}"), resource_version=resource_version,
                        state=state, **fields)  # type: ignore[arg-type]


def injected_pod_event(name: str, **changes: object) -> PodIsolation:
    """The event the verifier judges: pod `name` running on gpu-1, injected by the webhook, KAI's limit 4147m."""
    fields: dict[str, object] = {"resource_version": "5", "node_name": "gpu-1", "container": "main", "injected": True,
                                 "expected_limit": "4147m"}
    return pod_event(name, **{**fields, **changes})  # type: ignore[arg-type]


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
