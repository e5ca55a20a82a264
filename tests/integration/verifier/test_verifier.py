"""The verifier on a real bus: verdicts from a node agent's answers, retried when it is silent, never repeated."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable

import pytest

from kai_isolator.services.verifier.command import running
from kai_isolator.services.verifier.service import Verifier
from kai_isolator.services.verifier.settings import VerifierSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.events import (
    DeviceUsage, HealthVerdict, InspectReply, InspectRequest, NodeStatus, ProcessReport,
)
from kai_isolator.shared.settings import BusSettings
from support.bus import RuntimeFactory, injected_pod_event, publish_until_stored
from support.waiting import eventually

LIB = "/usr/local/vgpu/libvgpu.so"
GRANTED = 4147 << 20


class ScriptedAgent:
    """Stands in for the node agent on the bus; what each container looks like is set by the test."""

    def __init__(self) -> None:
        self.limits: dict[str, str | None] = {}
        self.requests: list[InspectRequest] = []
        self.setting_up: dict[str, int] = {}  # pod -> how many more looks find only its set-up process

    async def inspect(self, request: InspectRequest) -> InspectReply:
        self.requests.append(request)
        if request.pod.name not in self.limits:
            return InspectReply(node_name=request.node_name, pod=request.pod, container=request.container, found=False, message="no such process")
        if self.setting_up.get(request.pod.name, 0) > 0:
            # As a runtime's set-up process is seen: in the pod's cgroup with its environment, the preload not yet mounted.
            self.setting_up[request.pod.name] -= 1
            setup = ProcessReport(pid=99, preload=None, library_mapped=False, memory_limit_env=self.limits[request.pod.name])
            return InspectReply(node_name=request.node_name, pod=request.pod, container=request.container, found=True, processes=[setup])
        process = ProcessReport(pid=100, preload=LIB, library_mapped=True, library_version="v1", memory_limit_env=self.limits[request.pod.name])
        device = DeviceUsage(index=0, uuid="GPU-0", limit_bytes=GRANTED, used_bytes=1 << 30)
        return InspectReply(node_name=request.node_name, pod=request.pod, container=request.container, found=True, processes=[process], devices=[device])


@pytest.fixture
async def verdicts(start_runtime: RuntimeFactory) -> list[HealthVerdict]:
    seen: list[HealthVerdict] = []

    async def collect(verdict: HealthVerdict) -> None:
        seen.append(verdict)

    await start_runtime("observer", lambda r: r.on_event("health", subjects.ALL_HEALTH, collect))
    return seen


@pytest.fixture
async def agent(start_runtime: RuntimeFactory) -> ScriptedAgent:
    scripted = ScriptedAgent()
    await start_runtime("agent", lambda r: r.on_request(subjects.node_inspect("gpu-1"), scripted.inspect))
    return scripted


@pytest.fixture
async def verifier(bus_settings: BusSettings) -> AsyncIterator[Verifier]:
    settings = VerifierSettings(kubernetes_events=False, reverify_s=3600, pending_retry_s=0.5, inspect_timeout_s=1, confirm_negative_after_s=0.2)
    async with running(settings, bus_settings, bus_settings.nats_url or "") as started:
        yield started


async def test_verified_degraded_and_missing_reach_the_bus_and_kv(
    agent: ScriptedAgent, verifier: Verifier, verdicts: list[HealthVerdict], start_runtime: RuntimeFactory
) -> None:
    agent.limits.update({"good": "4147m", "wrong-limit": "8g"})
    publisher = await start_runtime("watcher-stand-in")
    for event in (injected_pod_event("good"), injected_pod_event("wrong-limit"), injected_pod_event("webhook-was-down", injected=False)):
        await publisher.publish(event)
    await eventually(lambda: len(verdicts) == 3)
    by_pod = {v.pod.name: v for v in verdicts}
    assert by_pod["good"].verdict == "verified"
    assert by_pod["wrong-limit"].verdict == "degraded" and [r.code for r in by_pod["wrong-limit"].reasons] == ["limit-mismatch"]
    assert by_pod["webhook-was-down"].verdict == "missing" and [r.code for r in by_pod["webhook-was-down"].reasons] == ["not-injected"]
    record = await verifier.runtime.kv("isolator-pod-health").get("verdict.uid-good.main")
    assert b'"verdict":"verified"' in (record.value or b"")
    assert {p.pod.name for p in await verifier.tracked_pods()} == {"good", "wrong-limit", "webhook-was-down"}


async def test_silent_agent_means_retries_and_no_verdict_until_it_answers(
    start_runtime: RuntimeFactory, verifier: Verifier, verdicts: list[HealthVerdict]
) -> None:
    publisher = await start_runtime("watcher-stand-in")
    await publisher.publish(injected_pod_event("p1"))
    handled = verifier.runtime.metrics.handled
    await eventually(lambda: handled.labels("verifier-pods", "dead_lettered")._value.get() == 1)  # every delivery failed
    assert handled.labels("verifier-pods", "retried")._value.get() == 2
    assert verdicts == []  # nobody answered: no verdict at all, certainly not "verified"
    scripted = ScriptedAgent()
    scripted.limits["p1"] = "4147m"
    await start_runtime("agent", lambda r: r.on_request(subjects.node_inspect("gpu-1"), scripted.inspect))
    await eventually(lambda: len(verdicts) == 1, timeout_s=15)  # the pending-pod retry found it
    assert verdicts[0].verdict == "verified"


async def test_container_without_processes_is_retried_not_judged(
    agent: ScriptedAgent, start_runtime: RuntimeFactory, verifier: Verifier, verdicts: list[HealthVerdict]
) -> None:
    publisher = await start_runtime("watcher-stand-in")
    await publisher.publish(injected_pod_event("starting"))
    await eventually(lambda: len(agent.requests) >= 2)  # asked, found nothing, asked again
    assert verdicts == []
    agent.limits["starting"] = "4147m"
    await eventually(lambda: len(verdicts) == 1, timeout_s=15)


async def test_a_container_not_started_yet_is_retried_at_info_level_and_nothing_warns(
    agent: ScriptedAgent, start_runtime: RuntimeFactory, bus_settings: BusSettings, verdicts: list[HealthVerdict],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No process yet is an expected state, not a failure: its retries (the event's and the passes') are
    logged at info, in words, and nothing warns."""
    caplog.set_level(logging.INFO, logger="kai_isolator")
    patient = bus_settings.model_copy(update={"max_deliver": 20})  # the container starts well before retries run out
    settings = VerifierSettings(kubernetes_events=False, reverify_s=3600, pending_retry_s=0.2, inspect_timeout_s=1,
                                confirm_negative_after_s=0.2)
    async with running(settings, patient, patient.nats_url or ""):
        publisher = await start_runtime("watcher-stand-in")
        await publisher.publish(injected_pod_event("starting"))
        await eventually(lambda: len(agent.requests) >= 4)
        agent.limits["starting"] = "4147m"
        await eventually(lambda: len(verdicts) == 1, timeout_s=15)
    not_yet = [r for r in caplog.records if "no process of team-a/starting:main" in str(getattr(r, "why", getattr(r, "error", "")))]
    assert not_yet and {r.levelno for r in not_yet} == {logging.INFO}, [(r.levelname, r.getMessage()) for r in not_yet]
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_same_observation_is_never_emitted_twice_even_across_a_restart(
    agent: ScriptedAgent, bus_settings: BusSettings, start_runtime: RuntimeFactory, verdicts: list[HealthVerdict]
) -> None:
    agent.limits["p1"] = "4147m"
    publisher = await start_runtime("watcher-stand-in")
    settings = VerifierSettings(kubernetes_events=False, reverify_s=3600, inspect_timeout_s=1, confirm_negative_after_s=0)
    async with running(settings, bus_settings, bus_settings.nats_url or "") as first:
        await publisher.publish(injected_pod_event("p1"))
        await eventually(lambda: len(verdicts) == 1)
        assert await first.verify(injected_pod_event("p1")) is None  # a re-verification seeing the same thing
    async with running(settings, bus_settings, bus_settings.nats_url or "") as second:
        await publisher.publish(injected_pod_event("p1", resource_version="6"))  # a new event, same observation
        await eventually(lambda: len(agent.requests) == 3)
        for pod in await second.tracked_pods():
            await second.verify(pod)
        agent.limits["p1"] = "2g"  # then something really changes
        assert await second.verify(injected_pod_event("p1")) is None  # a negative first look waits for a second one
        await second.verify(injected_pod_event("p1"))
        await eventually(lambda: len(verdicts) == 2)
    await asyncio.sleep(0.3)
    assert [v.verdict for v in verdicts] == ["verified", "degraded"]


async def test_library_version_change_on_a_node_reverifies_its_pods(
    agent: ScriptedAgent, start_runtime: RuntimeFactory, verifier: Verifier, verdicts: list[HealthVerdict]
) -> None:
    agent.limits["p1"] = "4147m"
    publisher = await start_runtime("watcher-stand-in")
    await publisher.publish(NodeStatus(node_name="gpu-1", sequence=1, ready=True, active_version="v1"))
    await publisher.publish(injected_pod_event("p1"))
    await eventually(lambda: len(verdicts) == 1)
    asked = len(agent.requests)
    agent.limits["p1"] = "1g"
    await publisher.publish(NodeStatus(node_name="gpu-1", sequence=2, ready=True, active_version="v2"))
    await eventually(lambda: len(verdicts) == 2)
    assert verdicts[1].verdict == "degraded"
    assert len(agent.requests) >= asked + 2  # the version change's look, then the second look that confirmed it


async def test_a_deleted_pod_is_forgotten_and_a_late_running_event_does_not_revive_it(
    agent: ScriptedAgent, start_runtime: RuntimeFactory, verifier: Verifier, verdicts: list[HealthVerdict]
) -> None:
    agent.limits["p1"] = "4147m"
    publisher: Runtime = await start_runtime("watcher-stand-in")
    await publisher.publish(injected_pod_event("p1"))
    await eventually(lambda: len(verdicts) == 1)
    await publisher.publish(injected_pod_event("p1", state="deleted", resource_version="7"))
    await eventually(lambda: verifier.runtime.metrics.handled.labels("verifier-pods", "ok")._value.get() == 2)
    assert await verifier.tracked_pods() == []
    await publisher.publish(injected_pod_event("p1", resource_version="8"))
    await eventually(lambda: verifier.runtime.metrics.handled.labels("verifier-pods", "ok")._value.get() == 3)
    assert await verifier.tracked_pods() == [] and len(verdicts) == 1


async def test_a_running_container_never_seen_is_unobservable_once(
    agent: ScriptedAgent, bus_settings: BusSettings, start_runtime: RuntimeFactory, verdicts: list[HealthVerdict]
) -> None:
    settings = VerifierSettings(kubernetes_events=False, reverify_s=3600, pending_retry_s=0.2, inspect_timeout_s=1,
                                unobservable_inspections=3, unobservable_after_s=1.0)
    async with running(settings, bus_settings, bus_settings.nats_url or "") as verifier:
        publisher = await start_runtime("watcher-stand-in")
        await publisher.publish(injected_pod_event("hidden"))  # e.g. `exec env -i` once hid it from an agent that looked for POD_UID
        await eventually(lambda: len(verdicts) == 1, timeout_s=15)
        first_ask = agent.requests[0]
        assert len(agent.requests) >= 3
        [verdict] = verdicts
        assert verdict.verdict == "degraded" and [r.code for r in verdict.reasons] == ["unobservable"]
        assert "3 inspections over at least 1s" in verdict.reasons[0].message
        asked = len(agent.requests)
        await asyncio.sleep(1.5)  # the pending-pod pass no longer retries it; redeliveries repeat nothing
        assert len(verdicts) == 1 and len(agent.requests) <= asked + settings_redeliveries(bus_settings)
        assert first_ask.container == "main"

        agent.limits["hidden"] = "4147m"  # its process shows up after all: judged as any other
        for tracked in await verifier.tracked_pods():
            await verifier.verify(tracked)
        await eventually(lambda: len(verdicts) == 2)
        assert verdicts[-1].verdict == "verified"


def settings_redeliveries(bus_settings: BusSettings) -> int:
    return bus_settings.max_deliver


# --- under NATS faults and container set-up (issue 20) -----------------------------------


def distinct(verdicts: Iterable[HealthVerdict]) -> list[str]:
    return [v.verdict for v in {v.observation: v for v in verdicts}.values()]



def sample(verifier: Verifier, name: str, **labels: str) -> float:
    return verifier.runtime.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_reverification_keeps_going_through_a_nats_crash_and_restart(
    agent: ScriptedAgent, bus_settings: BusSettings, nats_server, start_runtime: RuntimeFactory, verdicts: list[HealthVerdict]  # type: ignore[no-untyped-def]
) -> None:
    agent.limits["p1"] = "4147m"
    settings = VerifierSettings(kubernetes_events=False, reverify_s=0.3, pending_retry_s=0.3, inspect_timeout_s=1, confirm_negative_after_s=0.2)
    async with running(settings, bus_settings, bus_settings.nats_url or "") as verifier:
        publisher = await start_runtime("watcher-stand-in")
        await publisher.publish(injected_pod_event("p1"))
        await eventually(lambda: [v.verdict for v in verdicts] == ["verified"])

        nats_server.kill()  # SIGKILL: the verifier's KV calls time out while it is away
        await eventually(lambda: sample(verifier, "kai_isolator_bus_connected") == 0)
        # Longer than the JetStream timeout (5s, the default of jetstream_timeout_s), so a pass's KV
        # call really times out rather than being answered once the server is back.
        await asyncio.sleep(6.0)
        nats_server.start()  # same port, same store

        # Acks may die with the server, so p1's event may come again (at-least-once); a later pod's
        # verdict shows the verifier has worked through it, in stream order.
        agent.limits["p2"] = "4147m"
        await publish_until_stored(publisher, injected_pod_event("p2"))
        await eventually(lambda: "p2" in {v.pod.name for v in verdicts}, timeout_s=30)
        agent.limits["p1"] = "2g"  # from now on only a re-verification can notice a change in p1
        await eventually(lambda: distinct(v for v in verdicts if v.pod.name == "p1") == ["verified", "degraded"], timeout_s=30)
        assert sample(verifier, "kai_isolator_reverify_passes_total", outcome="failed") >= 1  # the outage was met ...
        ok = sample(verifier, "kai_isolator_reverify_passes_total", outcome="ok")
        await eventually(lambda: sample(verifier, "kai_isolator_reverify_passes_total", outcome="ok") > ok)  # ... and passes go on


async def test_a_container_still_being_set_up_is_never_judged_missing(
    agent: ScriptedAgent, start_runtime: RuntimeFactory, verifier: Verifier, verdicts: list[HealthVerdict]
) -> None:
    agent.limits["starting"] = "4147m"
    agent.setting_up["starting"] = 1  # the first look lands in the moment before the preload mount
    publisher = await start_runtime("watcher-stand-in")
    await publisher.publish(injected_pod_event("starting"))
    await eventually(lambda: len(verdicts) == 1, timeout_s=15)
    assert [v.verdict for v in verdicts] == ["verified"]
    assert agent.setting_up["starting"] == 0 and len(agent.requests) >= 2  # the set-up process was seen, and not judged
    assert sample(verifier, "kai_isolator_verdicts_deferred_total") == 1


async def test_a_negative_look_seen_again_is_issued_once(
    agent: ScriptedAgent, start_runtime: RuntimeFactory, verifier: Verifier, verdicts: list[HealthVerdict]
) -> None:
    agent.limits["no-preload"] = "4147m"
    agent.setting_up["no-preload"] = 1000  # never gets its preload: a real `missing`
    publisher = await start_runtime("watcher-stand-in")
    await publisher.publish(injected_pod_event("no-preload"))
    await eventually(lambda: len(verdicts) == 1, timeout_s=15)
    [verdict] = verdicts
    assert verdict.verdict == "missing" and [r.code for r in verdict.reasons] == ["no-preload"]
    assert len(agent.requests) >= 2  # issued on the second look, not the first
    for tracked in await verifier.tracked_pods():
        assert await verifier.verify(tracked) is None  # a later look that sees the same is never issued again
    assert len(verdicts) == 1


async def test_listing_tracked_pods_leaves_no_consumer_behind(
    agent: ScriptedAgent, start_runtime: RuntimeFactory, verifier: Verifier, verdicts: list[HealthVerdict]
) -> None:
    agent.limits.update({"a": "4147m", "b": "4147m"})
    publisher = await start_runtime("watcher-stand-in")
    for name in ("a", "b"):
        await publisher.publish(injected_pod_event(name))
    await eventually(lambda: len(verdicts) == 2)
    for _ in range(5):
        assert {p.pod.name for p in await verifier.tracked_pods()} == {"a", "b"}
    bucket = await verifier.runtime.jetstream.stream_info("KV_isolator-pod-health")
    assert bucket.state.consumer_count == 0


async def test_node_versions_live_in_kv_so_late_and_repeated_reports_reverify_nothing(
    agent: ScriptedAgent, bus_settings: BusSettings, start_runtime: RuntimeFactory, verifier: Verifier, verdicts: list[HealthVerdict]
) -> None:
    # As when reports are split between replicas: handled out of order, or by a verifier that never saw the last one.
    agent.limits["p1"] = "4147m"
    publisher = await start_runtime("watcher-stand-in")
    await publisher.publish(injected_pod_event("p1"))
    await eventually(lambda: len(verdicts) == 1)
    asked = len(agent.requests)
    await verifier.on_node_status(NodeStatus(node_name="gpu-1", sequence=10, ready=True, active_version="v1"))  # first sight: recorded
    assert len(agent.requests) == asked
    await verifier.on_node_status(NodeStatus(node_name="gpu-1", sequence=12, ready=True, active_version="v2"))
    assert len(agent.requests) == asked + 1
    await verifier.on_node_status(NodeStatus(node_name="gpu-1", sequence=11, ready=True, active_version="v1"))  # older, handled late
    await verifier.on_node_status(NodeStatus(node_name="gpu-1", sequence=12, ready=True, active_version="v2"))  # redelivered, done
    await verifier.on_node_status(NodeStatus(node_name="gpu-1", sequence=13, ready=True, active_version="v2"))  # heartbeat
    assert len(agent.requests) == asked + 1
    settings = VerifierSettings(kubernetes_events=False, reverify_s=3600, pending_retry_s=3600, inspect_timeout_s=1)
    async with running(settings, bus_settings, bus_settings.nats_url or "") as other:  # another replica, its memory empty
        await other.on_node_status(NodeStatus(node_name="gpu-1", sequence=14, ready=True, active_version="v2"))
        assert len(agent.requests) == asked + 1
        await other.on_node_status(NodeStatus(node_name="gpu-1", sequence=15, ready=True, active_version="v3"))
        assert len(agent.requests) == asked + 2


async def test_one_replica_runs_the_periodic_passes_and_another_takes_them_over(
    agent: ScriptedAgent, bus_settings: BusSettings, start_runtime: RuntimeFactory, verdicts: list[HealthVerdict]
) -> None:
    # Events are split between replicas by the consumer, but a pass goes over every pod: two replicas
    # both passing would inspect each pod twice as often and race each other to every new verdict.
    settings = VerifierSettings(kubernetes_events=False, reverify_s=0.2, pending_retry_s=0.2, inspect_timeout_s=1, reverify_lease_ttl_s=20)
    agent.limits["p1"] = "4147m"
    first_running = running(settings, bus_settings, bus_settings.nats_url or "")
    first = await first_running.__aenter__()
    stopped = False
    try:
        await eventually(lambda: first.pass_lease is not None and first.pass_lease.held())
        async with running(settings, bus_settings, bus_settings.nats_url or "") as second:
            standby = second.passes.labels("standby")._value.get
            await eventually(lambda: standby() >= 3)
            assert second.passes.labels("ok")._value.get() == 0 and first.passes.labels("ok")._value.get() > 0
            assert second.pass_lease is not None and not second.pass_lease.held()
            publisher = await start_runtime("watcher-stand-in")
            await publisher.publish(injected_pod_event("p1"))
            await eventually(lambda: len(verdicts) == 1)
            # A graceful stop releases the lease: the other replica takes the passes over at once, not
            # after the 20 s term (which would time this wait out; a standby polls every quarter term).
            await first_running.__aexit__(None, None, None)
            stopped = True
            await eventually(lambda: second.pass_lease is not None and second.pass_lease.held())
            asked = len(agent.requests)
            await eventually(lambda: len(agent.requests) > asked)  # the second now re-verifies p1 on its passes
            # The inspection is asked mid-pass; the pass is counted only once it has gone over every pod.
            await eventually(lambda: second.passes.labels("ok")._value.get() > 0)
            assert len(verdicts) == 1
    finally:
        if not stopped:
            await first_running.__aexit__(None, None, None)


# --- what a pass costs, and what it leaves alone ------------------------------------------

BUCKET = "isolator-pod-health"
NO_PASSES = dict(kubernetes_events=False, reverify_s=3600, pending_retry_s=3600, confirm_negative_after_s=0)


def count_reads(verifier: Verifier, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every key the verifier reads from its bucket from now on, in order."""
    kv = verifier.runtime.kv(BUCKET)
    reads: list[str] = []
    original = kv.get

    async def get(key: str, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        reads.append(key)
        return await original(key, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kv, "get", get)
    return reads


async def test_a_pass_reads_no_key_of_a_forgotten_pod(
    agent: ScriptedAgent, bus_settings: BusSettings, start_runtime: RuntimeFactory, verdicts: list[HealthVerdict],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The verifier's own passes are off: the test runs them, and counts what they read.
    gone = [f"gone-{i}" for i in range(30)]
    agent.limits.update({name: "4147m" for name in ["live", *gone]})
    publisher = await start_runtime("watcher-stand-in")
    async with running(VerifierSettings(**NO_PASSES), bus_settings, bus_settings.nats_url or "") as verifier:
        handled_ok = verifier.runtime.metrics.handled.labels("verifier-pods", "ok")._value.get
        for name in ["live", *gone]:
            await publisher.publish(injected_pod_event(name))
        await eventually(lambda: len(verdicts) == 31)
        for name in gone:
            await publisher.publish(injected_pod_event(name, state="deleted", resource_version="7"))
        await eventually(lambda: handled_ok() == 61)
        # Keys an older version left: it purged through the KV API, so a marker stayed listed per key.
        kv = verifier.runtime.kv(BUCKET)
        old = [f"uid-old-{i}" for i in range(10)]
        for uid in old:
            for key in (f"pod.{uid}", f"verdict.{uid}.main", f"pending.{uid}.main"):
                await kv.put(key, b"{}")
                await kv.purge(key)

        reads = count_reads(verifier, monkeypatch)
        await verifier.reverify_pass(full=True)
        assert not [key for key in reads if "uid-gone-" in key]  # the forgotten pods' keys are not even listed
        assert {key for key in reads if "uid-old-" in key} == {f"pod.{uid}" for uid in old}  # an old marker is read once ...
        assert await verifier.runtime.kv_keys(BUCKET, "pod.>") == ["pod.uid-live"]  # ... and listed no more
        assert await verifier.runtime.kv_keys(BUCKET, "verdict.>") == ["verdict.uid-live.main"]
        assert await verifier.runtime.kv_keys(BUCKET, "pending.>") == []

        reads.clear()
        await verifier.reverify_pass(full=True)
        assert reads and {key.split(".")[1] for key in reads} == {"uid-live"}  # every pass: the live pod's keys only
        reads.clear()
        await verifier.reverify_pass(full=False)
        assert reads == []  # nothing due: the live pod has its verdict and no look awaiting a second
        assert [v.pod.name for v in verdicts].count("live") == 1


class GatedAgent(ScriptedAgent):
    """Answers an inspection of a gated pod only once the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def inspect(self, request: InspectRequest) -> InspectReply:
        self.requests.append(request)
        await self.gate.wait()
        self.requests.pop()  # counted once, as asked
        return await super().inspect(request)


async def test_a_pod_whose_verification_is_in_flight_is_not_judged_again_by_a_pass(
    bus_settings: BusSettings, start_runtime: RuntimeFactory, verdicts: list[HealthVerdict],
) -> None:
    agent = GatedAgent()
    agent.limits["slow"] = "4147m"
    await start_runtime("agent", lambda r: r.on_request(subjects.node_inspect("gpu-1"), agent.inspect))
    publisher = await start_runtime("watcher-stand-in")
    settings = VerifierSettings(**{**NO_PASSES, "inspect_timeout_s": 60})
    async with running(settings, bus_settings, bus_settings.nats_url or "") as verifier:
        try:
            await publisher.publish(injected_pod_event("slow"))
            await eventually(lambda: len(agent.requests) == 1)  # its event's verification waits on the agent
            assert verifier.in_flight.busy("uid-slow")
            for full in (True, False, False):
                await verifier.reverify_pass(full)  # returns at once: the pod is left to the verification in flight
            assert len(agent.requests) == 1 and verdicts == []
            assert await verifier.verify(injected_pod_event("slow"), unless_in_flight=True) is None and len(agent.requests) == 1
        finally:
            agent.gate.set()
        await eventually(lambda: len(verdicts) == 1)
        assert [v.verdict for v in verdicts] == ["verified"] and len(agent.requests) == 1
        await eventually(lambda: len(verifier.in_flight) == 0)  # a claim nobody holds takes no memory


async def test_a_pod_without_a_verdict_is_left_to_its_event_handler_for_one_pass(
    agent: ScriptedAgent, bus_settings: BusSettings, verdicts: list[HealthVerdict],
) -> None:
    # As when another replica's handler is verifying it right now: a pass retries it only once it was
    # already without a verdict at the pass before.
    agent.limits["p1"] = "4147m"
    async with running(VerifierSettings(**NO_PASSES), bus_settings, bus_settings.nats_url or "") as verifier:
        await verifier.runtime.kv(BUCKET).put("pod.uid-p1", injected_pod_event("p1").model_dump_json().encode())
        await verifier.reverify_pass(full=False)
        assert agent.requests == []
        await verifier.reverify_pass(full=False)
        assert len(agent.requests) == 1
        await eventually(lambda: [v.verdict for v in verdicts] == ["verified"])
