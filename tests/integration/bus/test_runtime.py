"""The bus runtime against a real nats-server: delivery, retries, dead letters, de-duplication, state."""

from __future__ import annotations

import asyncio
import base64
import logging
import time

import pytest
from aiohttp import ClientSession

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError, NotYet
from kai_isolator.shared.events import (
    DeadLetter, HealthVerdict, InspectReply, InspectRequest, NodeStatus, PodIsolation, PodRef, decode,
)

from support.bus import RuntimeFactory, pod_event
from support.waiting import eventually


async def dead_letters(runtime: Runtime, service: str, count: int) -> list[DeadLetter]:
    sub = await runtime.jetstream.pull_subscribe(subjects.dlq(service), durable=None, stream=subjects.STREAM_NAME)
    letters: list[DeadLetter] = []
    deadline = time.monotonic() + 10
    while len(letters) < count and time.monotonic() < deadline:
        try:
            for msg in await sub.fetch(count, timeout=0.5):
                letters.append(decode(msg.data)[1])  # type: ignore[arg-type]
                await msg.ack()
        except asyncio.TimeoutError:
            pass
    return letters


async def test_typed_event_reaches_its_handler_and_its_output_is_published(start_runtime: RuntimeFactory) -> None:
    received: list[PodIsolation] = []
    verdicts: list[HealthVerdict] = []

    async def on_pod(event: PodIsolation) -> HealthVerdict:
        received.append(event)
        return HealthVerdict(pod=event.pod, node_name="n1", container="main", verdict="verified", observation="o1")

    async def on_health(event: HealthVerdict) -> None:
        verdicts.append(event)

    def setup(r: Runtime) -> None:
        r.on_event("pods", subjects.ALL_PODS, on_pod)
        r.on_event("health", subjects.ALL_HEALTH, on_health)

    runtime = await start_runtime("svc", setup)
    await runtime.publish(pod_event("p1"))
    await eventually(lambda: len(verdicts) == 1)
    assert isinstance(received[0], PodIsolation) and received[0].pod.name == "p1"
    assert verdicts[0].pod.uid == "uid-p1" and verdicts[0].verdict == "verified"


async def test_handler_only_gets_the_types_it_declares(start_runtime: RuntimeFactory) -> None:
    seen: list[object] = []

    async def only_status(event: NodeStatus) -> None:
        seen.append(event)

    runtime = await start_runtime("svc", lambda r: r.on_event("all", subjects.ALL_EVENTS, only_status))
    await runtime.publish(pod_event("ignored"))
    await runtime.publish(NodeStatus(node_name="gpu-1", sequence=1, ready=True))
    await eventually(lambda: len(seen) == 1)
    await asyncio.sleep(0.2)
    assert [type(e) for e in seen] == [NodeStatus]


async def test_failing_handler_is_retried_with_growing_backoff(start_runtime: RuntimeFactory) -> None:
    attempts: list[float] = []

    async def flaky(event: PodIsolation) -> None:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise RuntimeError("transient")

    runtime = await start_runtime("svc", lambda r: r.on_event("pods", subjects.ALL_PODS, flaky))
    await runtime.publish(pod_event("p1"))
    await eventually(lambda: len(attempts) == 3)
    first_gap, second_gap = attempts[1] - attempts[0], attempts[2] - attempts[1]
    assert first_gap >= 0.05 * 0.9 and second_gap >= 0.1 * 0.9  # base, then doubled
    await asyncio.sleep(0.5)
    assert len(attempts) == 3  # acked after success: no further delivery
    assert runtime.metrics.handled.labels("svc-pods", "retried")._value.get() == 2
    assert runtime.metrics.handled.labels("svc-pods", "ok")._value.get() == 1


async def test_a_handler_not_ready_yet_is_retried_without_a_warning_and_a_failure_still_warns(
    start_runtime: RuntimeFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """A typed "not yet" (a container still starting) is retried like a failure, but is no failure:
    it is logged at info. Anything else a handler raises still warns."""
    attempts: list[str] = []

    async def first_try_fails(event: PodIsolation) -> None:
        attempts.append(event.pod.name)
        if attempts.count(event.pod.name) == 1:
            raise NotYet("the container has not started") if event.pod.name == "starting" else RuntimeError("a bug")

    caplog.set_level(logging.INFO, logger="kai_isolator.shared.bus")
    runtime = await start_runtime("svc", lambda r: r.on_event("pods", subjects.ALL_PODS, first_try_fails))
    await runtime.publish(pod_event("starting"))
    await runtime.publish(pod_event("broken"))
    await eventually(lambda: attempts.count("starting") == 2 and attempts.count("broken") == 2)
    retries = [(r.levelno, r.getMessage(), getattr(r, "why", getattr(r, "error", ""))) for r in caplog.records
               if getattr(r, "retry_in_s", None) is not None]
    assert sorted(retries) == [
        (logging.INFO, "not ready yet; will look again", "the container has not started"),
        (logging.WARNING, "handler failed; will retry", "RuntimeError: a bug"),
    ]


async def test_not_yet_past_its_deliveries_is_handed_over_not_dead_lettered(start_runtime: RuntimeFactory, caplog: pytest.LogCaptureFixture) -> None:
    """A container slower to start than the deliveries last is normal: the verifier's passes look again, so
    the bus acknowledges it at info instead of raising the dead-letter alarm. A real failure still dead-letters."""
    attempts: list[str] = []

    async def never_ready(event: PodIsolation) -> None:
        attempts.append(event.pod.name)
        if event.pod.name == "slow":
            raise NotYet("the container has not started")
        raise ValueError("a bug")

    caplog.set_level(logging.INFO, logger="kai_isolator.shared.bus")
    runtime = await start_runtime("svc", lambda r: r.on_event("pods", subjects.ALL_PODS, never_ready))
    await runtime.publish(pod_event("slow"))
    await runtime.publish(pod_event("broken"))
    [letter] = await dead_letters(runtime, "svc", 1)
    await eventually(lambda: runtime.metrics.handled.labels("svc-pods", "handed_over")._value.get() == 1)
    assert attempts.count("slow") == 3 == attempts.count("broken")
    assert "broken" in letter.original_subject
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "slow" in str(getattr(r, "why", ""))]
    assert any(r.getMessage() == "still not ready; left to the handler's own later look" for r in caplog.records)


async def test_message_that_keeps_failing_lands_on_the_dead_letter_subject(start_runtime: RuntimeFactory) -> None:
    attempts = 0

    async def always_fails(event: PodIsolation) -> None:
        nonlocal attempts
        attempts += 1
        raise ValueError(f"cannot handle {event.pod.name}")

    runtime = await start_runtime("svc", lambda r: r.on_event("pods", subjects.ALL_PODS, always_fails))
    await runtime.publish(pod_event("poison"))
    [letter] = await dead_letters(runtime, "svc", 1)
    assert attempts == 3 == letter.deliveries
    assert "cannot handle poison" in letter.error and "ValueError" in letter.error
    assert letter.original_subject == subjects.pod("team-a", "poison")
    assert decode(base64.b64decode(letter.payload_base64))[1] == pod_event("poison")
    await asyncio.sleep(0.5)
    assert attempts == 3  # terminated, not redelivered


@pytest.mark.parametrize(
    "raw, expected_error",
    [
        (b"\x00\xff not json", "not a CloudEvents 1.0 JSON envelope"),
        (b'{"specversion":"1.0","id":"x","source":"s","type":"io.example.unknown.v1"}', "unknown event type"),
        (b'{"specversion":"1.0","id":"x","source":"s","type":"io.kai-isolator.pod.running.v1","data":{"pod":1}}', "invalid io.kai-isolator.pod.running.v1 data"),
        (b'{"specversion":"0.3","id":"x","source":"s","type":"io.kai-isolator.pod.running.v1"}', "specversion"),
    ],
)
async def test_undecodable_payloads_are_dead_lettered_and_processing_continues(
    start_runtime: RuntimeFactory, raw: bytes, expected_error: str
) -> None:
    handled: list[PodIsolation] = []

    async def on_pod(event: PodIsolation) -> None:
        handled.append(event)

    runtime = await start_runtime("svc", lambda r: r.on_event("pods", subjects.ALL_PODS, on_pod))
    await runtime.jetstream.publish(subjects.pod("team-a", "garbage"), raw)
    await runtime.publish(pod_event("good"))
    await eventually(lambda: len(handled) == 1)
    [letter] = await dead_letters(runtime, "svc", 1)
    assert expected_error in letter.error and letter.deliveries == 1
    assert base64.b64decode(letter.payload_base64) == raw


async def test_duplicate_message_id_is_dropped(start_runtime: RuntimeFactory) -> None:
    handled: list[PodIsolation] = []

    async def on_pod(event: PodIsolation) -> None:
        handled.append(event)

    runtime = await start_runtime("svc", lambda r: r.on_event("pods", subjects.ALL_PODS, on_pod))
    for _ in range(3):
        await runtime.publish(pod_event("p1", resource_version="7"))
    await runtime.publish(pod_event("p1", resource_version="8"))
    await eventually(lambda: len(handled) == 2)
    await asyncio.sleep(0.3)
    assert [e.resource_version for e in handled] == ["7", "8"]
    assert runtime.metrics.published.labels("duplicate")._value.get() == 2


async def test_kv_state_survives_a_runtime_restart(start_runtime: RuntimeFactory) -> None:
    first = await start_runtime("svc", kv_buckets=["pod-state"])
    await first.kv("pod-state").put("team-a.p1", b"verified")
    await first.stop()
    second = await start_runtime("svc", kv_buckets=["pod-state"])
    entry = await second.kv("pod-state").get("team-a.p1")
    assert entry.value == b"verified"
    with pytest.raises(BusError, match="not provisioned"):
        second.kv("other")


async def test_kv_keys_lists_by_pattern_and_leaves_no_consumer(start_runtime: RuntimeFactory) -> None:
    runtime = await start_runtime("svc", kv_buckets=["pod-state"])
    assert await runtime.kv_keys("pod-state") == []  # an empty bucket is an empty list, not an error
    kv = runtime.kv("pod-state")
    for key in ("pod.a", "pod.b", "gone.a", "verdict.a.main"):
        await kv.put(key, b"x")
    for _ in range(5):
        assert await runtime.kv_keys("pod-state", "pod.>") == ["pod.a", "pod.b"]
    assert await runtime.kv_keys("pod-state") == ["gone.a", "pod.a", "pod.b", "verdict.a.main"]
    info = await runtime.jetstream.stream_info("KV_pod-state")
    assert info.state.consumer_count == 0  # nats-py's kv.keys() leaves one behind per call, for five minutes
    with pytest.raises(BusError, match="not provisioned"):
        await runtime.kv_keys("other")


async def test_request_reply_returns_typed_reply_or_a_clear_error(start_runtime: RuntimeFactory) -> None:
    async def inspect(request: InspectRequest) -> InspectReply:
        if request.container == "boom":
            raise RuntimeError("proc scan failed")
        return InspectReply(node_name=request.node_name, pod=request.pod, container=request.container, found=True)

    await start_runtime("agent", lambda r: r.on_request(subjects.node_inspect("gpu-1"), inspect))
    caller = await start_runtime("caller")
    pod = PodRef(namespace="team-a", name="p1", uid="u1")
    reply = await caller.request(InspectRequest(node_name="gpu-1", pod=pod, container="main"))
    assert isinstance(reply, InspectReply) and reply.found and reply.container == "main"
    with pytest.raises(BusError, match="proc scan failed"):
        await caller.request(InspectRequest(node_name="gpu-1", pod=pod, container="boom"))
    with pytest.raises(BusError, match="nobody answers"):
        await caller.request(InspectRequest(node_name="gpu-2", pod=pod, container="main"), timeout_s=1)


async def test_garbage_request_gets_an_error_reply_not_silence(start_runtime: RuntimeFactory) -> None:
    async def inspect(request: InspectRequest) -> InspectReply:
        raise AssertionError("must not be called")

    agent = await start_runtime("agent", lambda r: r.on_request(subjects.node_inspect("gpu-1"), inspect))
    reply = await agent._connected().request(subjects.node_inspect("gpu-1"), b"{not json", timeout=2)
    assert "not a CloudEvents" in decode(reply.data)[1].error  # type: ignore[attr-defined]


async def test_probes_report_readiness_and_metrics(start_runtime: RuntimeFactory) -> None:
    async def on_pod(event: PodIsolation) -> None:
        return None

    runtime = await start_runtime("svc", lambda r: r.on_event("pods", subjects.ALL_PODS, on_pod), probe_listen="127.0.0.1:0")
    await runtime.publish(pod_event("p1"))
    await eventually(lambda: runtime.metrics.handled.labels("svc-pods", "ok")._value.get() == 1)
    async with ClientSession() as http:
        for path, status in (("/healthz", 200), ("/readyz", 200)):
            async with http.get(runtime.probe_url + path) as response:
                assert response.status == status
        async with http.get(runtime.probe_url + "/metrics") as response:
            text = await response.text()
    assert 'kai_isolator_bus_messages_total{handler="svc-pods",outcome="ok"} 1.0' in text
    assert "kai_isolator_bus_connected 1.0" in text


async def test_readyz_is_503_until_the_bus_is_connected(bus_settings) -> None:  # type: ignore[no-untyped-def]
    runtime = Runtime("svc", bus_settings, probe_listen="127.0.0.1:0")
    assert runtime.not_ready() == ["bus not connected"]
    await runtime.start(bus_settings.nats_url)
    assert runtime.not_ready() == []
    await runtime.stop()
