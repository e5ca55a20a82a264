"""Decision events on a real NATS: every decision is published as a typed AdmissionDecision, and
with NATS gone the webhook keeps answering every request while counting what it drops."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import orjson
import pytest

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.events import AdmissionDecision
from kai_isolator.shared.settings import BusSettings

from support.bus import RuntimeFactory
from support.waiting import eventually

JSON = {"Content-Type": "application/json"}


async def subscribe(start_runtime: RuntimeFactory) -> list[AdmissionDecision]:
    seen: list[AdmissionDecision] = []

    async def on_decision(event: AdmissionDecision) -> None:
        seen.append(event)

    def setup(runtime: Runtime) -> None:
        runtime.on_event("decisions", subjects.ALL_ADMISSION, on_decision)

    await start_runtime("audit", setup)
    return seen


async def mutate(client: aiohttp.ClientSession, url: str, body: bytes) -> dict[str, Any]:
    async with client.post(url + "/mutate", data=body, headers=JSON) as response:
        assert response.status == 200
        return orjson.loads(await response.read())["response"]


def metric(server: Any, name: str, **labels: str) -> float:
    return server.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def on_bus(start_webhook: Any, start_runtime: RuntimeFactory, bus_settings: BusSettings) -> tuple[Any, list[AdmissionDecision]]:
    """A webhook publishing to the test's NATS, and every decision event an auditor sees there."""
    seen = await subscribe(start_runtime)
    server = await start_webhook(bus_settings)
    await eventually(server.publisher.bus_ready.is_set)
    return server, seen


async def test_every_decision_is_published(
    on_bus: tuple[Any, list[AdmissionDecision]], client: aiohttp.ClientSession, reviews: Any,
) -> None:
    gpu_pod, review_bytes = reviews
    server, seen = on_bus
    escaping = gpu_pod("escape", "team-b")
    escaping["spec"]["containers"][0]["env"] = [{"name": "LD_PRELOAD", "value": "/x.so"}]
    await mutate(client, server.url, review_bytes(gpu_pod("plain"), uid="u-injected"))
    await mutate(client, server.url, review_bytes(gpu_pod("out", **{"kai-resource-isolator.io/inject": "false"}), uid="u-skipped"))
    await mutate(client, server.url, review_bytes(gpu_pod("lost", **{"gpu-fraction-container-name": "nope"}), uid="u-denied"))
    await mutate(client, server.url, review_bytes(escaping, uid="u-warned"))
    await eventually(lambda: len(seen) == 4)
    by_uid = {event.request_uid: event for event in seen}
    injected = by_uid["u-injected"]
    assert (injected.decision, injected.namespace, injected.pod_name, injected.container) == ("injected", "team-a", "plain", "main")
    assert injected.patch_operations == 3
    assert by_uid["u-skipped"].decision == "skipped" and "opted out" in by_uid["u-skipped"].reason
    assert by_uid["u-denied"].decision == "denied" and "nope" in by_uid["u-denied"].reason
    warned = by_uid["u-warned"]
    assert warned.decision == "warned" and warned.namespace == "team-b" and warned.findings == ["container main sets LD_PRELOAD"]
    assert metric(server, "kai_isolator_admission_events_published_total") == 4


async def test_a_request_sent_again_is_stored_once_and_counted_as_a_duplicate(
    on_bus: tuple[Any, list[AdmissionDecision]], client: aiohttp.ClientSession, reviews: Any,
) -> None:
    # The API server calls a webhook again, same uid, when the first call timed out on its side.
    gpu_pod, review_bytes = reviews
    server, seen = on_bus
    for _ in range(2):
        await mutate(client, server.url, review_bytes(gpu_pod("again"), uid="u-again"))
        await eventually(lambda: server.publisher.pending == 0)
    await eventually(lambda: metric(server, "kai_isolator_bus_published_total", outcome="duplicate") == 1)
    assert metric(server, "kai_isolator_bus_published_total", outcome="stored") == 1
    await asyncio.sleep(0.2)
    assert [event.request_uid for event in seen] == ["u-again"]


async def test_a_dry_run_is_answered_and_counted_but_never_published(
    on_bus: tuple[Any, list[AdmissionDecision]], client: aiohttp.ClientSession, reviews: Any,
) -> None:
    """`kubectl apply --dry-run=server` reaches the webhook (it declares sideEffects: None) yet creates no pod."""
    gpu_pod, review_bytes = reviews
    server, seen = on_bus
    review = orjson.loads(review_bytes(gpu_pod("rehearsal"), uid="u-dry"))
    review["request"]["dryRun"] = True
    for _ in range(3):  # the same body again too: an answer replayed for it must not publish either
        dry = await mutate(client, server.url, orjson.dumps(review))
    real = await mutate(client, server.url, review_bytes(gpu_pod("rehearsal"), uid="u-real"))
    assert dry["patch"] == real["patch"] and dry["allowed"] is True
    await eventually(lambda: len(seen) == 1)
    await asyncio.sleep(0.2)  # a dry run's event would have been sent before the real one's: none is on the way
    assert [event.request_uid for event in seen] == ["u-real"]
    assert metric(server, "kai_isolator_admission_decisions_total", decision="injected") == 4


async def test_nats_stopped_mid_load_costs_no_answer(
    start_webhook: Any, start_runtime: RuntimeFactory, bus_settings: BusSettings, nats_server: Any,
    client: aiohttp.ClientSession, reviews: Any,
) -> None:
    gpu_pod, review_bytes = reviews
    seen = await subscribe(start_runtime)
    server = await start_webhook(bus_settings, event_queue_size=50, publish_concurrency=4)
    await eventually(server.publisher.bus_ready.is_set)

    async def burst(prefix: str, count: int) -> None:
        async def one(i: int) -> None:
            response = await mutate(client, server.url, review_bytes(gpu_pod(f"p{i}"), uid=f"{prefix}-{i}"))
            assert response["allowed"] is True and response["uid"] == f"{prefix}-{i}" and response["patchType"] == "JSONPatch"

        for start in range(0, count, 25):
            await asyncio.gather(*(one(i) for i in range(start, min(count, start + 25))))

    await burst("before", 50)
    await eventually(lambda: len(seen) >= 50)

    nats_server.kill()
    await burst("during", 400)
    assert server.publisher.pending <= 50
    dropped = sum(metric(server, "kai_isolator_admission_events_dropped_total", reason=r) for r in ("queue_full", "publish_failed"))
    assert dropped > 0

    nats_server.start()
    # What was queued during the outage goes out once the bus is back; new decisions follow it.
    await eventually(lambda: server.publisher.pending == 0, timeout_s=30)
    await burst("after", 10)
    await eventually(lambda: any(e.request_uid.startswith("after-") for e in seen), timeout_s=30)


async def test_decisions_whose_acks_died_with_the_server_are_sent_again_on_reconnect_and_stored_once(
    start_webhook: Any, start_runtime: RuntimeFactory, bus_settings: BusSettings, nats_server: Any,
    client: aiohttp.ClientSession, reviews: Any,
) -> None:
    # The ack timeout is put out of the test's reach (30 s): only a send again on the lost connection
    # can store these decisions in time. SIGSTOP first, so they reach the server's socket and die in it.
    gpu_pod, review_bytes = reviews
    seen = await subscribe(start_runtime)
    server = await start_webhook(bus_settings.model_copy(update={"jetstream_timeout_s": 30.0}))
    await eventually(server.publisher.bus_ready.is_set)
    await mutate(client, server.url, review_bytes(gpu_pod("first"), uid="first"))
    # Its ack in too, not only its delivery: stopped before the ack left, the server would hold 21 unacknowledged.
    await eventually(lambda: len(seen) == 1 and server.publisher.pending == 0)
    nats_server._process.send_signal(signal.SIGSTOP)
    for i in range(20):
        await mutate(client, server.url, review_bytes(gpu_pod(f"p{i}"), uid=f"lost-{i}"))
    await eventually(lambda: server.publisher.pending == 20 and not server.publisher._buffer)  # all sent, none acked
    nats_server.kill()
    nats_server.start()
    await eventually(lambda: server.publisher.pending == 0, timeout_s=20)
    await eventually(lambda: len(seen) == 21, timeout_s=20)
    await asyncio.sleep(0.2)
    assert sorted(e.request_uid for e in seen) == sorted(["first", *(f"lost-{i}" for i in range(20))])
    assert sum(metric(server, "kai_isolator_admission_events_dropped_total", reason=r) for r in ("queue_full", "publish_failed")) == 0
