"""The whole stack under steady pod churn on a real three-node R3 NATS cluster and the real kube-apiserver, faults injected.

What runs: three nats-server processes (routes, JetStream, R3 stream and buckets); the real kube-apiserver +
etcd (`dev_cluster`, KAI's admission, binder and two GPU nodes' kubelets simulated through its API); our
admission webhook served in-process and registered in the API server as deploy/ registers it (so the API
server itself calls it, over TLS, for every GPU-sharing pod); two watcher and two verifier processes (the
replicated services, so a kill is a real SIGKILL); a node agent per node in-process (host root in tmp, the
fake driver of hami-core/build).

The faults, one after another under the churn: the stream leader SIGKILLed and restarted, then a follower;
the stream leader partitioned away (SIGSTOP, then SIGCONT); the leading watcher SIGKILLed (a replacement
started, as its Deployment would); the verifier holding the pass lease SIGKILLed (replaced too).

Asserted: every pod's story complete on the bus (the admission decision; admitted, scheduled, running and
deleted; a verdict), nothing published twice (README: a fact is published once, a retry inside the
duplicate window is absorbed by its Nats-Msg-Id; verdicts are keyed by observation; decisions by request
uid), no service crashed, and /readyz was false only inside a fault's window and is true again after.
What each fault did to the latency from a pod change to its event is printed, never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
import nats.js.errors
import pytest

from kai_isolator.services.admission.certs import issue
from kai_isolator.services.admission.server import AdmissionServer
from kai_isolator.services.admission.settings import AdmissionSettings
from kai_isolator.services.devcluster.cluster import ApiCallError, DevCluster
from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu
from kai_isolator.services.nodeagent.agent import NodeAgent
from kai_isolator.services.nodeagent.dev import LIBRARY
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import ClusterMember, EmbeddedCluster
from kai_isolator.shared.events import AdmissionDecision, HealthVerdict, PodIsolation, decode
from kai_isolator.shared.operator_view import ISOLATED_CONDITION
from kai_isolator.shared.ports import free_port
from kai_isolator.shared.settings import BusSettings
from kai_isolator.shared.tail import read_stream
from support.waiting import eventually

from .conftest import lease_holder, stream_leader, stream_state

NAMESPACE = "churn"
NODES = {"gpu-node-1": 15360, "gpu-node-2": 15360}
OPT_OUT_EVERY = 5  # every fifth pod opts out by annotation: its story has isolation-missing and a `missing` verdict
CHURN_PERIOD_S = 0.25  # a new pod this often (the create itself waits on both webhooks)
WATCHER_TTL_S = 2.0
GRACE_S = 20.0  # how long after a fault has been undone a service may still be catching up (not ready)
STORY = ("admitted", "scheduled", "running", "deleted")


@pytest.fixture
def dev_cluster_options() -> dict[str, Any]:
    return {"nodes": dict(NODES), "step_s": 0.05}


# --- the pods ------------------------------------------------------------------------------------


@dataclass
class ChurnPod:
    name: str
    opted_out: bool
    created_at: float  # epoch seconds when the API server answered the create
    deleted_at: float | None = None


def pod_body(name: str, node: str, opted_out: bool) -> dict[str, Any]:
    annotations = {"gpu-memory": "4096"} | ({"kai-resource-isolator.io/inject": "false"} if opted_out else {})
    # RuntimeDefault seccomp: without it the webhook's policy (warn mode) finds a user-namespace escape and says `warned`.
    return {"metadata": {"name": name, "annotations": annotations},
            "spec": {"schedulerName": "kai-scheduler", "containers": [{"name": "main", "image": "busybox"}],
                     "nodeSelector": {"kubernetes.io/hostname": node}, "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}}


def judged(pod: dict[str, Any]) -> bool:
    """The verifier's verdict reached the pod (its condition): the pod may go, its verdict is on the bus."""
    return any(c.get("type") == ISOLATED_CONDITION for c in (pod.get("status") or {}).get("conditions") or [])


# --- fault phases and readiness --------------------------------------------------------------------


@dataclass
class Timeline:
    """Which fault was in effect when: phases follow each other; a window spans a fault until it is undone."""

    phases: list[tuple[str, float]] = field(default_factory=lambda: [("steady", time.time())])
    windows: list[tuple[str, float, float]] = field(default_factory=list)

    def phase_at(self, at: float) -> str:
        label = self.phases[0][0]
        for name, started in self.phases:
            if started <= at:
                label = name
        return label

    @contextlib.asynccontextmanager
    async def fault(self, label: str) -> AsyncIterator[None]:
        started = time.time()
        self.phases.append((label, started))
        yield
        self.windows.append((label, started, time.time()))

    def explains(self, at: float) -> bool:
        return any(start <= at <= end + GRACE_S for _, start, end in self.windows)


@dataclass
class Probed:
    """One service replica whose /readyz and /healthz the test polls."""

    name: str
    base_url: str
    ssl_context: ssl.SSLContext | None = None
    process: asyncio.subprocess.Process | None = None
    killed_at: float | None = None
    samples: list[tuple[float, int]] = field(default_factory=list)

    async def status(self, session: aiohttp.ClientSession, path: str) -> int:
        try:
            async with session.get(self.base_url + path, ssl=self.ssl_context or False, timeout=aiohttp.ClientTimeout(total=2)) as answer:
                await answer.read()
                return answer.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return 0

    async def text(self, session: aiohttp.ClientSession, path: str) -> str:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with session.get(self.base_url + path, ssl=self.ssl_context or False, timeout=aiohttp.ClientTimeout(total=2)) as answer:
                return await answer.text()
        return ""

    def unready_spans(self) -> list[tuple[float, float]]:
        """Runs of consecutive not-ready samples, as (first, last) epoch seconds."""
        spans: list[tuple[float, float]] = []
        start: float | None = None
        last = 0.0
        for at, code in self.samples:
            if code != 200 and start is None:
                start = at
            elif code == 200 and start is not None:
                spans.append((start, last))
                start = None
            last = at
        if start is not None:
            spans.append((start, last))
        return spans


async def poll_readiness(services: list[Probed], stop: asyncio.Event) -> None:
    """Every 0.25 s, each live replica's /readyz; what it answered and when."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            live = [s for s in services if s.killed_at is None]
            codes = await asyncio.gather(*(s.status(session, "/readyz") for s in live))
            now = time.time()
            for service, code in zip(live, codes):
                service.samples.append((now, code))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)


# --- the services --------------------------------------------------------------------------------


def service_env(url: str) -> dict[str, str]:
    """Bus settings of the replicated services: R3, quick retries, a paused server left after ~2 s."""
    return {**os.environ, "KAI_ISOLATOR_NATS_URL": url, "KAI_ISOLATOR_NATS_REPLICAS": "3", "KAI_ISOLATOR_NATS_PING_INTERVAL_S": "1",
            "KAI_ISOLATOR_BACKOFF_BASE_S": "0.05", "KAI_ISOLATOR_BACKOFF_MAX_S": "0.5", "KAI_ISOLATOR_ACK_WAIT_S": "3",
            "KAI_ISOLATOR_JETSTREAM_TIMEOUT_S": "3", "KAI_ISOLATOR_NATS_CONNECT_TIMEOUT_S": "20", "KAI_ISOLATOR_LOG_LEVEL": "info"}


WATCHER_ENV = {"KAI_ISOLATOR_WATCHER_LEASE_TTL_S": str(WATCHER_TTL_S), "KAI_ISOLATOR_WATCHER_RESUME_SAVE_INTERVAL_S": "0.2",
               "KAI_ISOLATOR_WATCHER_BACKOFF_MAX_S": "0.5"}
VERIFIER_ENV = {
    # The simulated kubelet runs no process, so an injected pod's verdict is `degraded: unobservable`
    # after two looks by its node agent; redeliveries are those looks, so allow plenty of them.
    "KAI_ISOLATOR_VERIFIER_UNOBSERVABLE_INSPECTIONS": "2", "KAI_ISOLATOR_VERIFIER_UNOBSERVABLE_AFTER_S": "0.2",
    "KAI_ISOLATOR_MAX_DELIVER": "30", "KAI_ISOLATOR_FETCH_BATCH": "4",
    "KAI_ISOLATOR_VERIFIER_PENDING_RETRY_S": "2", "KAI_ISOLATOR_VERIFIER_REVERIFY_S": "3600",
    "KAI_ISOLATOR_VERIFIER_REVERIFY_LEASE_TTL_S": "3", "KAI_ISOLATOR_VERIFIER_NODE_VIEW_INTERVAL_S": "2",
}


async def spawn(kind: str, url: str, kubeconfig: Path, logs: Path, extra_env: dict[str, str]) -> Probed:
    """A watcher or verifier process, ready (/readyz 200) before it counts."""
    port = free_port()
    log_path = logs / f"{kind}-{port}.log"
    with open(log_path, "wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kai_isolator.services.cli", kind, "--kubeconfig", str(kubeconfig), "--probe-listen", f"127.0.0.1:{port}",
            env={**service_env(url), **extra_env}, stdout=out, stderr=out)
    service = Probed(f"{kind}:{process.pid}", f"http://127.0.0.1:{port}", process=process)
    async with aiohttp.ClientSession() as session:
        async def ready() -> bool:
            assert process.returncode is None, f"{kind} exited {process.returncode}: {log_path.read_text(errors='replace')[-2000:]}"
            return await service.status(session, "/readyz") == 200
        await eventually(ready, 90, what=f"{kind} ready", every_s=0.25)
    return service


async def kill(service: Probed) -> None:
    assert service.process is not None
    service.killed_at = time.time()
    service.process.kill()
    await service.process.wait()


async def start_admission(workdir: Path, bus: BusSettings, dev_cluster: DevCluster) -> tuple[AdmissionServer, Probed]:
    """Our webhook as services/admission/dev.py serves it, registered in the real API server as deploy/ does (Fail)."""
    pair = issue(["localhost", "127.0.0.1"])
    ca, cert, key = pair.write(workdir / "admission")
    server = AdmissionServer(AdmissionSettings(listen="127.0.0.1:0", tls_cert_file=cert, tls_private_key_file=key), bus)
    await server.start()
    await dev_cluster.register_webhook(f"{server.url}/mutate", pair.ca_pem, failure_policy="Fail")
    return server, Probed("admission", server.url, ssl.create_default_context(cafile=str(ca)))


async def start_agent(node: str, workdir: Path, bus: BusSettings, kubeconfig: Path, nvml: Path) -> tuple[NodeAgent, Probed]:
    root = workdir / f"host-{node}"
    root.mkdir(parents=True, exist_ok=True)
    settings = NodeAgentSettings(node_name=node, host_root=root, library=[LIBRARY], status_interval_s=5, usage_interval_s=5,
                                 kubeconfig=kubeconfig, nvml_library=str(nvml), breach_tolerance_mib=0, gc_grace_s=0)
    agent = NodeAgent(settings, bus, probe_listen="127.0.0.1:0")
    await agent.start(bus.nats_url or "")
    return agent, Probed(f"nodeagent:{node}", agent.runtime.probe_url)


def holder_pid(holder: str | None) -> int | None:
    """`service@host:pid:suffix` -> pid."""
    try:
        return int((holder or "").split(":")[-2])
    except (IndexError, ValueError):
        return None


async def replica_holding(url: str, key: str, replicas: list[Probed]) -> Probed:
    holding: list[Probed] = []

    async def held() -> bool:
        pid = holder_pid(await lease_holder(url, key))
        holding[:] = [r for r in replicas if r.process is not None and r.process.pid == pid]
        return bool(holding)
    await eventually(held, 30, what=f"a replica holds {key}", every_s=0.25)
    return holding[0]


async def caught_up(cluster: EmbeddedCluster) -> bool:
    """The stream has a leader and both followers are current again."""
    try:
        _, _, current = await stream_state(cluster)
    except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
        return False
    return len(current) == len(cluster.members) - 1


# --- reading the bus -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    id: str
    subject: str
    payload: Any
    at: float  # when the stream stored it (epoch seconds, the server's clock: this machine's)
    made: float  # the event's own time: when its publisher made it (the webhook: when it decided)


async def stored_events(url: str) -> list[Stored]:
    """Every event in the stream, in stream order, with its store time."""
    found: list[Stored] = []
    for message in await read_stream(url):
        envelope, payload = decode(message.data)
        found.append(Stored(envelope.id, message.subject, payload, message.metadata.timestamp.timestamp(), envelope.time.timestamp()))
    return found


@dataclass
class Stories:
    """The bus's account of each pod, by name (names are unique in this test)."""

    decisions: dict[str, list[AdmissionDecision]] = field(default_factory=dict)
    states: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    verdicts: dict[str, list[tuple[HealthVerdict, float]]] = field(default_factory=dict)
    ids: Counter[str] = field(default_factory=Counter)
    dead_letters: int = 0

    @classmethod
    def of(cls, events: list[Stored]) -> Stories:
        """A pod's decisions in the order the webhook made them: it sends them pipelined, and one resent after a server
        was lost is stored after a later one. The watcher sends one pod's states one at a time: stream order is theirs."""
        stories = cls()
        for e in sorted(events, key=lambda e: e.made if isinstance(e.payload, AdmissionDecision) else 0.0):
            stories.ids[e.id] += 1
            p = e.payload
            if isinstance(p, AdmissionDecision) and p.namespace == NAMESPACE:
                stories.decisions.setdefault(p.pod_name, []).append(p)
            elif isinstance(p, PodIsolation) and p.pod.namespace == NAMESPACE:
                stories.states.setdefault(p.pod.name, []).append((p.state, e.at))
            elif isinstance(p, HealthVerdict) and p.pod.namespace == NAMESPACE:
                stories.verdicts.setdefault(p.pod.name, []).append((p, e.at))
            elif e.subject.startswith(subjects.ALL_DLQ[:-1]):
                stories.dead_letters += 1
        return stories

    def missing(self, pods: list[ChurnPod]) -> dict[str, list[str]]:
        """What each pod's story still lacks."""
        gaps: dict[str, list[str]] = {}
        for pod in pods:
            seen = [s for s, _ in self.states.get(pod.name, [])]
            lacks = [s for s in STORY if s not in seen]
            lacks += ["isolation-missing"] if pod.opted_out and "isolation-missing" not in seen else []
            lacks += ["decision"] if pod.name not in self.decisions else []
            lacks += ["verdict"] if pod.name not in self.verdicts else []
            if lacks:
                gaps[pod.name] = lacks
        return gaps

    def at(self, name: str, state: str) -> float | None:
        return next((t for s, t in self.states.get(name, []) if s == state), None)


def latency_table(pods: list[ChurnPod], stories: Stories, timeline: Timeline) -> dict[str, dict[str, list[float]]]:
    """Per phase: created -> `admitted`, delete call -> `deleted`, `running` -> verdict, in seconds."""
    table: dict[str, dict[str, list[float]]] = {}
    for pod in pods:
        samples: list[tuple[str, float, float | None]] = [("create->admitted", pod.created_at, stories.at(pod.name, "admitted"))]
        if pod.deleted_at is not None:
            samples.append(("delete->deleted", pod.deleted_at, stories.at(pod.name, "deleted")))
        running = stories.at(pod.name, "running")
        if running is not None and stories.verdicts.get(pod.name):
            samples.append(("running->verdict", running, stories.verdicts[pod.name][0][1]))
        for what, changed, seen in samples:
            if seen is not None:
                table.setdefault(timeline.phase_at(changed), {}).setdefault(what, []).append(seen - changed)
    return table


def print_latencies(table: dict[str, dict[str, list[float]]], timeline: Timeline) -> None:
    print("\nlatency pod change -> event on the bus, by the fault in effect at the change (n, p50, max seconds):")
    for label, _ in timeline.phases:
        if label not in table:
            continue
        cells = [f"{what} n={len(v)} p50={statistics.median(v):.3f} max={max(v):.3f}" for what, v in sorted(table[label].items())]
        print(f"  {label:28s} " + "; ".join(cells))


# --- the test ------------------------------------------------------------------------------------


async def inject_faults(cluster: EmbeddedCluster, timeline: Timeline, start_replica: Callable[[str], Awaitable[Probed]],
                        watchers: list[Probed], verifiers: list[Probed]) -> None:
    """The faults, one after another, each undone (restarted, resumed, replaced) before a few steady seconds."""
    url = cluster.url
    await asyncio.sleep(6)
    async with timeline.fault("stream leader SIGKILL"):
        leader = await stream_leader(cluster)
        leader.kill()
        await asyncio.sleep(4)
        await asyncio.to_thread(leader.start)
        await eventually(lambda: caught_up(cluster), 60, what="stream replicas current after the leader's restart", every_s=0.25)
    await asyncio.sleep(3)
    async with timeline.fault("stream follower SIGKILL"):
        current_leader = await stream_leader(cluster)
        follower: ClusterMember = next(m for m in cluster.members if m is not current_leader)
        follower.kill()
        await asyncio.sleep(4)
        await asyncio.to_thread(follower.start)
        await eventually(lambda: caught_up(cluster), 60, what="stream replicas current after the follower's restart", every_s=0.25)
    await asyncio.sleep(3)
    async with timeline.fault("stream leader partitioned"):
        partitioned = await stream_leader(cluster)
        partitioned.pause()  # SIGSTOP: its sockets stay open, it answers nobody
        await asyncio.sleep(6)
        partitioned.resume()
        await eventually(lambda: caught_up(cluster), 60, what="stream replicas current after the partition healed", every_s=0.25)
    await asyncio.sleep(3)
    async with timeline.fault("watcher leader SIGKILL"):
        await kill(await replica_holding(url, "watcher.all", watchers))
        watchers.append(await start_replica("watcher"))  # as its Deployment would replace it
        await replica_holding(url, "watcher.all", [w for w in watchers if w.killed_at is None])
    await asyncio.sleep(3)
    async with timeline.fault("verifier SIGKILL"):
        # The replica holding the pass lease: mid-work on its share of the consumers and on the passes.
        await kill(await replica_holding(url, "verifier.passes", verifiers))
        verifiers.append(await start_replica("verifier"))
    timeline.phases.append(("after the faults", time.time()))
    await asyncio.sleep(5)


@pytest.mark.timeout(240)
async def test_whole_stack_under_churn_through_nats_and_replica_faults(
        nats_cluster: EmbeddedCluster, bus_settings: BusSettings, dev_cluster: DevCluster, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    url, kubeconfig = nats_cluster.url, dev_cluster.kubeconfig
    gpu = FakeGpu(tmp_path / "nvidia-driver").start()  # the fake NVML's node-wide ledger, beside it
    request.addfinalizer(gpu.stop)
    await dev_cluster.ensure_namespace(NAMESPACE)
    probed: list[Probed] = []
    agents: list[tuple[NodeAgent, Probed]] = []
    pods: list[ChurnPod] = []
    live: list[ChurnPod] = []
    refused: list[str] = []
    stop_churn, stop_polling = asyncio.Event(), asyncio.Event()

    async def start_replica(kind: str) -> Probed:
        replica = await spawn(kind, url, kubeconfig, tmp_path, WATCHER_ENV if kind == "watcher" else VERIFIER_ENV)
        probed.append(replica)
        return replica

    async def delete_judged(limit: int = 3) -> None:
        # The oldest few live pods that have their verdict go; one still waiting does not hold up the others.
        for pod in list(live[:limit]):
            try:
                current = await dev_cluster.get("pods", NAMESPACE, pod.name)
            except ApiCallError:
                continue
            if judged(current):
                await dev_cluster.delete("pods", NAMESPACE, pod.name)
                pod.deleted_at = time.time()
                live.remove(pod)

    async def churn() -> None:
        i = 0
        while not stop_churn.is_set():
            name, opted_out = f"c-{i}", i % OPT_OUT_EVERY == OPT_OUT_EVERY - 1
            try:
                await dev_cluster.create("pods", pod_body(name, list(NODES)[i % len(NODES)], opted_out), NAMESPACE)
                pod = ChurnPod(name, opted_out, time.time())
                pods.append(pod)
                live.append(pod)
            except ApiCallError as error:
                refused.append(f"{name}: {error.code}")  # the webhook unreachable under failurePolicy Fail: no pod, no story
            with contextlib.suppress(ApiCallError):
                await delete_judged()
            i += 1
            await asyncio.sleep(CHURN_PERIOD_S)

    admission, admission_probe = await start_admission(tmp_path, bus_settings, dev_cluster)
    probed.append(admission_probe)
    poller: asyncio.Task[None] | None = None
    try:
        for node in NODES:
            agents.append(await start_agent(node, tmp_path, bus_settings, kubeconfig, gpu.nvml))
            probed.append(agents[-1][1])
        watchers = list(await asyncio.gather(*(start_replica("watcher") for _ in range(2))))
        verifiers = list(await asyncio.gather(*(start_replica("verifier") for _ in range(2))))
        timeline = Timeline()  # from the first pod on: the set-up is no phase
        poller = asyncio.create_task(poll_readiness(probed, stop_polling), name="readiness")
        churner = asyncio.create_task(churn(), name="churn")
        try:
            await inject_faults(nats_cluster, timeline, start_replica, watchers, verifiers)
        finally:
            stop_churn.set()
            await churner
        await settle(dev_cluster, live)
        stories = Stories()

        async def told() -> bool:
            nonlocal stories
            stories = Stories.of(await stored_events(url))
            return not stories.missing(pods)

        with contextlib.suppress(AssertionError):  # what is still missing then is named by check()
            await eventually(told, 60, what="every pod's story on the bus", every_s=2)
        stop_polling.set()
        await poller
        await check(stories, pods, refused, probed, timeline, agents, admission)
    finally:
        stop_polling.set()
        if poller is not None:
            await poller
        await stop_all(probed, agents, admission)


async def settle(dev_cluster: DevCluster, live: list[ChurnPod]) -> None:
    """The pods still there: each waits for its verdict, then goes; until the namespace is empty."""
    async def all_judged() -> bool:
        pods = {p["metadata"]["name"]: p for p in await dev_cluster.list("pods", NAMESPACE)}
        return all(judged(pods[p.name]) for p in live if p.name in pods)
    await eventually(all_judged, 90, what="a verdict for every live pod", every_s=1)
    for pod in live:
        with contextlib.suppress(ApiCallError):
            await dev_cluster.delete("pods", NAMESPACE, pod.name)
            pod.deleted_at = time.time()

    async def empty() -> bool:
        return not await dev_cluster.list("pods", NAMESPACE)
    await eventually(empty, 60, what="every deleted pod gone from the API", every_s=0.5)


async def check(stories: Stories, pods: list[ChurnPod], refused: list[str], probed: list[Probed], timeline: Timeline,
                agents: list[tuple[NodeAgent, Probed]], admission: AdmissionServer) -> None:
    print(f"\n{len(pods)} pods through the stack ({sum(p.opted_out for p in pods)} opted out), {len(refused)} creates refused, "
          f"{sum(stories.ids.values())} events stored, {stories.dead_letters} dead letters")
    print_latencies(latency_table(pods, stories, timeline), timeline)
    print_readiness(probed, timeline)
    dropped = admission_dropped(admission)
    print(f"admission: decisions dropped {dropped}, still waiting for the bus {admission.publisher.pending}")
    # Every story complete, and in order.
    assert stories.missing(pods) == {}
    for pod in pods:
        seen = [s for s, _ in stories.states[pod.name]]
        expected = ["admitted", *(["isolation-missing"] if pod.opted_out else []), "scheduled", "running", "deleted"]
        assert seen == expected, (pod.name, seen)
        # Ours, KAI's, ours again (KAI's configuration sorts after ours): the reinvocation finds the pod injected.
        wanted = ["skipped", "skipped"] if pod.opted_out else ["injected", "skipped"]
        assert [d.decision for d in stories.decisions[pod.name]] == wanted, pod.name
        verdict = stories.verdicts[pod.name]
        assert len(verdict) == 1, (pod.name, [v.verdict for v, _ in verdict])  # one observation, one verdict
        reasons = {r.code for r in verdict[0][0].reasons}
        assert (verdict[0][0].verdict, reasons) == (("missing", {"not-injected"}) if pod.opted_out else ("degraded", {"unobservable"})), pod.name
    # Nothing stored twice: every id once (a retry within the duplicate window was absorbed).
    assert [i for i, n in stories.ids.items() if n > 1] == []
    # No service crashed: the replicas not killed on purpose still run and serve; the in-process ones' loops are alive.
    async with aiohttp.ClientSession() as session:
        absorbed = sum([await duplicates_absorbed(s, session) for s in probed if s.killed_at is None])
        print(f"publishes answered as duplicates (retries absorbed by the duplicate window), replicas still running: {absorbed:.0f}")
        for service in probed:
            if service.killed_at is None:
                assert service.process is None or service.process.returncode is None, service.name
                assert await service.status(session, "/healthz") == 200, service.name
                assert await service.status(session, "/readyz") == 200, service.name  # readiness came back
    for agent, _ in agents:
        assert all(not task.done() for task in agent._loops), agent.node
    assert admission.publisher.pending == 0
    assert sum(dropped.values()) == 0, dropped  # every decision stored, none given up on
    # Not ready only while a fault (or its aftermath) kept the service from working.
    unexplained = {s.name: [(round(a - timeline.phases[0][1], 1), round(b - timeline.phases[0][1], 1)) for a, b in s.unready_spans()
                            if not (timeline.explains(a) and timeline.explains(b))] for s in probed}
    assert {k: v for k, v in unexplained.items() if v} == {}


async def duplicates_absorbed(service: Probed, session: aiohttp.ClientSession) -> float:
    """Publishes the stream answered as duplicates (a retry of a stored message), from the replica's /metrics."""
    prefix = 'kai_isolator_bus_published_total{outcome="duplicate"} '
    return sum(float(line.split()[-1]) for line in (await service.text(session, "/metrics")).splitlines() if line.startswith(prefix))


def admission_dropped(admission: AdmissionServer) -> dict[str, float]:
    """The webhook's decision events not published, by why (its own counters)."""
    registry = admission.registry
    return {reason: registry.get_sample_value("kai_isolator_admission_events_dropped_total", {"reason": reason}) or 0.0
            for reason in ("queue_full", "no_bus", "publish_failed", "unroutable")}


def print_readiness(probed: list[Probed], timeline: Timeline) -> None:
    zero = timeline.phases[0][1]
    print("faults (s from the start): " + ", ".join(f"{label} {a - zero:.1f}-{b - zero:.1f}" for label, a, b in timeline.windows))
    print("/readyz not 200 (s from the start):")
    for service in probed:
        spans = ", ".join(f"{a - zero:.1f}-{b - zero:.1f}" for a, b in service.unready_spans()) or "never"
        print(f"  {service.name:24s} {spans}" + (f" (SIGKILLed at {service.killed_at - zero:.1f})" if service.killed_at else ""))


async def stop_all(probed: list[Probed], agents: list[tuple[NodeAgent, Probed]], admission: AdmissionServer) -> None:
    for service in probed:
        if service.process is not None and service.process.returncode is None:
            service.process.terminate()
    for service in probed:
        if service.process is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(service.process.wait(), 20)
            if service.process.returncode is None:
                service.process.kill()
                await service.process.wait()
    for agent, _ in agents:
        await agent.stop()
    await admission.stop()
