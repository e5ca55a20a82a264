"""Two verifier processes on one durable consumer on a three-node R3 cluster: each pod judged once per
observation, a library version change re-verifies the node's pods exactly once although node reports
are split between the replicas, and a replica SIGKILLed mid-work loses nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from itertools import count
from pathlib import Path

import nats
import pytest

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import EmbeddedCluster
from kai_isolator.shared.events import DeviceUsage, HealthVerdict, InspectReply, InspectRequest, NodeStatus, ProcessReport
from kai_isolator.shared.settings import BusSettings
from support.bus import RuntimeFactory, injected_pod_event
from support.processes import ServiceProcess, start_service
from support.waiting import eventually

from .conftest import stream_events

LIB = "/usr/local/vgpu/libvgpu.so"
BUCKET = "isolator-pod-health"
NODES = ("gpu-1", "gpu-2")


class AgentStandIn:
    """Answers inspections for both nodes as a healthy node agent would, and records who was asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.delay_s = 0.0

    async def inspect(self, request: InspectRequest) -> InspectReply:
        self.asked.append(request.pod.name)
        await asyncio.sleep(self.delay_s)  # slow inspections keep a replica mid-work long enough to be killed there
        process = ProcessReport(pid=100, preload=LIB, library_mapped=True, library_version="v1", memory_limit_env="4147m")
        device = DeviceUsage(index=0, uuid="GPU-0", limit_bytes=4147 << 20, used_bytes=1 << 30)
        return InspectReply(node_name=request.node_name, pod=request.pod, container=request.container, found=True,
                            processes=[process], devices=[device])


VERIFIER_ENV = {"KAI_ISOLATOR_NATS_REPLICAS": "3", "KAI_ISOLATOR_NATS_PING_INTERVAL_S": "1", "KAI_ISOLATOR_BACKOFF_BASE_S": "0.05",
                "KAI_ISOLATOR_ACK_WAIT_S": "3",
                # One message per fetch, so the replicas really share each consumer's messages.
                "KAI_ISOLATOR_FETCH_BATCH": "1",
                # No periodic pass: every inspection the test counts comes from an event.
                "KAI_ISOLATOR_VERIFIER_REVERIFY_S": "3600", "KAI_ISOLATOR_VERIFIER_PENDING_RETRY_S": "3600",
                "KAI_ISOLATOR_LOG_LEVEL": "info"}


def handled_ok(verifier: ServiceProcess, consumer: str) -> float:
    return verifier.metric(f'kai_isolator_bus_messages_total{{handler="{consumer}",outcome="ok"}}')


async def consumers_settled(url: str) -> bool:
    """Nothing waiting and nothing being worked on in the verifier's shared consumers."""
    nc = await nats.connect(url.split(","))
    try:
        js = nc.jetstream(timeout=3)
        for durable in ("verifier-pods", "verifier-nodes"):
            info = await js.consumer_info(subjects.STREAM_NAME, durable)
            if info.num_pending or info.num_ack_pending:
                return False
        return True
    finally:
        await nc.close()


async def until_settled(url: str, timeout_s: float = 90) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await consumers_settled(url):
        assert loop.time() < deadline, "the verifiers' consumers never settled"
        await asyncio.sleep(0.2)


async def node_record(url: str, node: str) -> bytes:
    nc = await nats.connect(url.split(","))
    try:
        kv = await nc.jetstream(timeout=3).key_value(BUCKET)
        return (await kv.get(f"nodeversion.{node}")).value or b""
    finally:
        await nc.close()


@pytest.mark.timeout(300)
async def test_two_verifiers_judge_once_reverify_once_and_survive_a_kill(
        nats_cluster: EmbeddedCluster, start_runtime: RuntimeFactory, tmp_path: Path) -> None:
    url = nats_cluster.url
    agent = AgentStandIn()

    def answer_inspections(runtime) -> None:  # type: ignore[no-untyped-def]
        for node in NODES:
            runtime.on_request(subjects.node_inspect(node), agent.inspect)

    await start_runtime("agent", answer_inspections)
    publisher = await start_runtime("watcher-stand-in")
    verifiers = [await start_service(["verifier", "--no-kubernetes-events"], {"KAI_ISOLATOR_NATS_URL": url, **VERIFIER_ENV}, tmp_path,
                                     ready_timeout_s=60) for _ in range(2)]
    sequence = count(1)

    async def report(node: str, version: str) -> None:
        # One report at a time, each handled before the next: the two replicas' pull requests take turns.
        await publisher.publish(NodeStatus(node_name=node, sequence=next(sequence), ready=True, active_version=version))
        await until_settled(url)

    pods = {f"p{i}": NODES[i % 2] for i in range(12)}
    on_gpu1 = sorted(p for p, n in pods.items() if n == "gpu-1")
    for node in NODES:
        await report(node, "v1")
    for name, node in pods.items():
        await publisher.publish(injected_pod_event(name, node_name=node))
    await until_settled(url)
    assert Counter(agent.asked) == {p: 1 for p in pods}  # each pod judged once, by one replica
    assert all(handled_ok(v, "verifier-pods") > 0 for v in verifiers)  # ... and the replicas shared them

    # Heartbeats of an unchanged version, then the change and its heartbeats, alternating between the
    # replicas: a replica keeping versions in memory would miss the change or re-verify it twice.
    for _ in range(4):
        await report("gpu-1", "v1")
    assert all(handled_ok(v, "verifier-nodes") >= 2 for v in verifiers)
    before_change = len(agent.asked)
    for version in ("v2", "v2", "v2", "v2"):
        await report("gpu-1", version)
    assert Counter(agent.asked[before_change:]) == {p: 1 for p in on_gpu1}  # the node's pods, each exactly once
    assert b'"version":"v2"' in await node_record(url, "gpu-1") and b'"reverify":false' in await node_record(url, "gpu-1")

    # A replica SIGKILLed in the middle of a re-verification, with new pods on the other node in flight.
    agent.delay_s = 0.5
    before_kill = len(agent.asked)
    logged = {id(v): len(v.log_text()) for v in verifiers}
    await publisher.publish(NodeStatus(node_name="gpu-1", sequence=next(sequence), ready=True, active_version="v3"))
    late_pods = {f"late{i}": "gpu-2" for i in range(6)}
    for name, node in late_pods.items():
        await publisher.publish(injected_pod_event(name, node_name=node))

    def worker() -> ServiceProcess | None:
        for v in verifiers:
            if "re-verifying the node's pods" in v.log_text()[logged[id(v)]:]:
                return v
        return None

    await eventually(lambda: worker() is not None and any(p in on_gpu1 for p in agent.asked[before_kill:]), timeout_s=30)
    killed = worker()
    assert killed is not None
    killed.process.kill()
    await killed.process.wait()
    killed_at = len(agent.asked)
    assert not set(on_gpu1) <= set(agent.asked[before_kill:killed_at])  # killed before it had asked about them all
    survivor = next(v for v in verifiers if v is not killed)
    await until_settled(url)

    after = agent.asked[before_kill:]
    assert set(after) == set(on_gpu1) | set(late_pods)  # every pod of the change and every new pod: nothing lost
    assert set(on_gpu1) - set(agent.asked[before_kill:killed_at]) <= set(agent.asked[killed_at:])  # the survivor finished the work
    assert b'"version":"v3"' in await node_record(url, "gpu-1") and b'"reverify":false' in await node_record(url, "gpu-1")
    verdicts = [v for v in await stream_events(url, subjects.ALL_HEALTH) if isinstance(v, HealthVerdict)]
    assert Counter(v.pod.name for v in verdicts) == {p: 1 for p in [*pods, *late_pods]}  # one verdict per observation
    assert {v.verdict for v in verdicts} == {"verified"}
    assert survivor.process.returncode is None and survivor.get("/readyz")[0] == 200
    survivor.process.terminate()
    assert await asyncio.wait_for(survivor.process.wait(), 30) == 0


async def test_two_verifiers_write_one_fresh_node_view(nats_cluster: EmbeddedCluster, bus_settings: BusSettings, dev_cluster: DevCluster,
                                                       start_runtime: RuntimeFactory) -> None:
    # Status reports are split between the replicas' consumers; a replica writing the view from its own
    # share would, at each heartbeat, put back a status another replica had already replaced.
    # The view is an annotation on the real API server's Node (the simulated kubelet registered it).
    import json

    from kai_isolator.services.verifier.command import running
    from kai_isolator.services.verifier.settings import VerifierSettings
    from kai_isolator.shared.operator_view import NODE_VIEW_ANNOTATION

    settings = VerifierSettings(kubeconfig=dev_cluster.kubeconfig, reverify_s=3600, pending_retry_s=3600,
                                node_view_interval_s=0.1, node_view_heartbeat_s=0.2, reverify_lease_ttl_s=20)
    publisher = await start_runtime("agent-stand-in")
    sequence = count(1)

    async def self_check() -> str | None:
        node = await dev_cluster.get("nodes", None, "gpu-node-1")
        annotation = (node["metadata"].get("annotations") or {}).get(NODE_VIEW_ANNOTATION)
        return json.loads(annotation)["self_check"] if annotation else None

    async with running(settings, bus_settings, url := nats_cluster.url) as first, running(settings, bus_settings, url) as second:
        assert [first.views_leading(), second.views_leading()].count(True) == 1
        for outcome in ("passed", "passed", "passed", "failed"):
            await publisher.publish(NodeStatus(node_name="gpu-node-1", sequence=next(sequence), ready=True, active_version="v1",
                                               self_check=outcome))  # type: ignore[arg-type]
            await until_settled(url)
        for _ in range(500):
            if await self_check() == "failed":
                break
            await asyncio.sleep(0.02)
        assert await self_check() == "failed"
        for _ in range(10):  # heartbeats come and go: the one writer holds every report, the latest last
            await asyncio.sleep(0.2)
            assert await self_check() == "failed"
