"""End-to-end latencies on the dev stack (`kai-isolator dev`): every service in this one process, beside real etcd, kube-apiserver, NATS.

The stack is what `kai-isolator dev` composes: an embedded NATS, the admission webhook, the local control
plane (a real etcd + kube-apiserver; KAI-Scheduler's admission/scheduler/binder and the GPU node's kubelet
simulated through the API), watcher, node agent, installer and verifier. Every clock starts when the
triggering change is committed (the API server's answer to the write) and stops when the outcome is seen,
on a subscription opened before any trigger: NATS core subscriptions for bus events, a watch for Events.

  (a) GPU-sharing pod Running -> `verified` verdict on the bus. The pod is injected and bound as usual;
      the bench then is the node's kubelet: it starts the container as a real process (the demo kubelet's
      `start_container`: private mount namespace, /etc/ld.so.preload -> libvgpu.so, the fake driver),
      waits until its program made its first allocation (where the library attaches the usage cache the
      verifier reads), and only then writes the Running status with the container's id, as a real kubelet
      reports Running only once the runtime started it. Clock: that status write's answer.
      Goal p99 <= 1 s.
  (b) Pod admitted without injection (alternately the inject: "false" annotation and a namespace labelled
      out of the webhook) -> the verifier's Warning Event on the pod, seen on a watch of the API's Events.
      Clock: the create's answer, so the simulated scheduler's and kubelet's steps (0.2 s each) are in it.
      Goal p99 <= 2 s.
  (c) A new node: the library installed -> ready. A Node is registered (`dev_cluster.add_node`), then a
      second node agent is started for it (the dev component, on its own host root); clock: from its start
      to its NodeStatus ready with the self-check passed on the bus.

Printed for each: p50/p99/max beside its goal, the stages in between (p50/p99), what the outcome was, and
the CPU per pod of this process (the whole stack but etcd, the API server and NATS, which are printed
apart; the containers' processes are the load, also apart) — the stack shares the cores with the load.
The default run (200 pods for (a), 100 for (b), 5 nodes for (c), 4 pods in flight) takes about a minute
on 2 cores after the control plane is built (`make control-plane`).

Run: .venv/bin/python bench/e2e.py [--pods 200] [--missing-pods 100] [--nodes 5] [--in-flight 4]
                                    [--log-level error] [--profile e2e.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import dataclasses
import io
import itertools
import logging
import os
import pstats
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.msg import Msg

from kai_isolator.services import registry
from kai_isolator.services.dev import DevContext, _provision
from kai_isolator.services.demo.kubelet import CgroupPlacement, ContainerProcess, start_container
from kai_isolator.services.demo.scenario import CUDA_PROGRAM, HAMI_BUILD, NODE, demo_pod
from kai_isolator.services.devcluster.api import STRATEGIC_MERGE_PATCH
from kai_isolator.services.devcluster.cluster import NAMESPACE_OPT_OUT, DevCluster
from kai_isolator.services.devcluster.kubelet import running_status
from kai_isolator.services.nodeagent import dev as nodeagent_dev
from kai_isolator.shared import logs, subjects
from kai_isolator.shared.contract import GRANT_VOLUME, INJECT_ANNOTATION, VGPU_VOLUME
from kai_isolator.shared.embedded_nats import bus_url
from kai_isolator.shared.errors import DecodeError, IsolatorError
from kai_isolator.shared.events import GrantDecision, HealthVerdict, NodeStatus, Payload, PodIsolation, decode
from kai_isolator.shared.settings import BusSettings, LogSettings, load

NAMESPACE = "default"
OPTED_OUT_NAMESPACE = "e2e-opted-out"
# The label the webhook's namespaceSelector excludes, taken from the registration itself.
OPT_OUT_LABEL = {NAMESPACE_OPT_OUT["matchExpressions"][0]["key"]: NAMESPACE_OPT_OUT["matchExpressions"][0]["values"][0]}
GOAL_VERIFIED_P99_S = 1.0
GOAL_WARNING_P99_S = 2.0
STEP_TIMEOUT_S = 30.0
# A pod goes this long after its outcome was seen (off the clock, in the background): what the verifier does
# after its verdict (the Event, the pod condition) then meets the pod, instead of a 404 that would be logged.
CLEANUP_AFTER_S = 1.0
# The container's program: the library loads at exec (preload); its first allocation attaches the usage cache
# (the verifier wants one: a container inspected before its first CUDA call is held for a second look, 2 s
# later); then it holds its context and 64 MiB until killed.
CONTAINER_ARGV = [str(CUDA_PROGRAM), "init", "ctx", "0", "alloc", str(64 << 20), "waitfile", "/nonexistent/e2e-never"]
CONTAINER_READY = ("init", "ctx", "alloc")  # its lines up to the first allocation, each `<command> ... rc=0 ...`
BUS_SUBJECTS = (f"{subjects.ROOT}.pod.>", f"{subjects.ROOT}.health.>", f"{subjects.ROOT}.grant.>", f"{subjects.ROOT}.node.*.status")
CHILD_COMMANDS = ("kube-apiserver", "etcd", "nats-server")


class StepTimeout(Exception):
    """An outcome did not arrive in time: the pod counts as failed, the run goes on."""


# --- observing ------------------------------------------------------------------------------


class Clock:
    """When each outcome was first seen (perf_counter seconds), keyed e.g. ("verdict", pod uid); wait on any key."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, ...], tuple[float, Any]] = {}
        self._waiters: dict[tuple[str, ...], list[asyncio.Future[tuple[float, Any]]]] = collections.defaultdict(list)

    def mark(self, key: tuple[str, ...], at: float, what: Any) -> None:
        if key in self.seen:
            return
        self.seen[key] = (at, what)
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result((at, what))

    async def wait(self, key: tuple[str, ...], timeout_s: float = STEP_TIMEOUT_S) -> tuple[float, Any]:
        if key in self.seen:
            return self.seen[key]
        waiter: asyncio.Future[tuple[float, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[key].append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            raise StepTimeout(f"no {' '.join(k for k in (key[0], *key[2:]))} within {timeout_s:g}s") from None


def bus_keys(payload: Payload) -> list[tuple[str, ...]]:
    """The clock keys a bus event settles."""
    if isinstance(payload, PodIsolation):
        return [("pod", payload.pod.uid, payload.state)]
    if isinstance(payload, HealthVerdict) and payload.verdict != "breached":  # the enforcer's own verdicts are not the verifier's
        return [("verdict", payload.pod.uid)]
    if isinstance(payload, GrantDecision) and payload.outcome == "written":
        return [("grant", payload.pod.uid)]
    if isinstance(payload, NodeStatus) and payload.ready and payload.self_check == "passed":
        return [("ready", payload.node_name)]
    return []


@contextlib.asynccontextmanager
async def watching_bus(url: str, clock: Clock) -> AsyncIterator[None]:
    """Core subscriptions to the event subjects: each message is timed on arrival, before it is decoded."""

    async def on_message(msg: Msg) -> None:
        at = time.perf_counter()
        try:
            _, payload = decode(msg.data)
        except DecodeError:
            return
        for key in bus_keys(payload):
            clock.mark(key, at, payload)

    nc = await nats.connect(url, name="bench-e2e")
    try:
        for subject in BUS_SUBJECTS:
            await nc.subscribe(subject, cb=on_message)
        await nc.flush()  # the server has the interest before any trigger
        yield
    finally:
        await nc.drain()


@contextlib.asynccontextmanager
async def watching_warnings(cluster: DevCluster, clock: Clock) -> AsyncIterator[None]:
    """A watch of every Warning Event in the API: ("warning", involved pod uid) -> the Event."""
    async def on_event(kind: str, event: dict[str, Any]) -> None:
        at = time.perf_counter()
        uid = (event.get("involvedObject") or {}).get("uid")
        if kind == "ADDED" and uid:
            clock.mark(("warning", uid), at, event)

    assert cluster.api is not None
    # A sentinel Event seen (listed or watched) proves the watch runs from before any trigger.
    task = asyncio.create_task(cluster.api.informer("/api/v1/events?fieldSelector=type%3DWarning", on_event))
    await cluster.create("events", {
        "metadata": {"name": "e2e-sentinel"}, "type": "Warning", "reason": "BenchSentinel", "message": "bench/e2e.py",
        "involvedObject": {"kind": "Pod", "namespace": NAMESPACE, "name": "e2e-sentinel", "uid": "e2e-sentinel"}}, NAMESPACE)
    await clock.wait(("warning", "e2e-sentinel"))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class WarningCounter(logging.Handler):
    """Counts what the stack logs at warning and above (shown only at --log-level warning)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.name}: {record.getMessage()[:90]}"] += 1


# --- CPU ------------------------------------------------------------------------------------


def _proc_cpu_s(pid: int | str) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> dict[str, float]:
    """CPU seconds so far of the stack's own binaries (direct children of this process), by command."""
    found: dict[str, float] = collections.defaultdict(float)
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            if rest.split()[1] == me and name in CHILD_COMMANDS:
                found[name] += _proc_cpu_s(entry.name)
    return dict(found)


def _reaped_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class CpuMeter:
    """CPU over one phase: this process, the stack's binaries, and the reaped children (the containers)."""

    own: float = field(default_factory=time.process_time)
    binaries: dict[str, float] = field(default_factory=children_cpu_s)
    reaped: float = field(default_factory=_reaped_s)

    def per_item_ms(self, items: int) -> str:
        now_binaries = children_cpu_s()
        parts = [f"this process (stack + bench) {(time.process_time() - self.own) / items * 1e3:.1f} ms"]
        parts += [f"{name} {(now_binaries.get(name, 0.0) - self.binaries.get(name, 0.0)) / items * 1e3:.1f} ms" for name in CHILD_COMMANDS]
        parts.append(f"reaped children (the containers) {(_reaped_s() - self.reaped) / items * 1e3:.1f} ms")
        return "; ".join(parts)


# --- figures --------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def latency_line(label: str, values: list[float], goal_s: float | None = None) -> str:
    ms = [v * 1e3 for v in values]
    line = f"    {label:<44} p50 {percentile(ms, .5):7.1f} ms  p99 {percentile(ms, .99):7.1f} ms  max {max(ms, default=float('nan')):7.1f} ms"
    if goal_s is not None:
        met = "met" if values and percentile(values, .99) <= goal_s else "MISSED"
        line += f"   goal p99 <= {goal_s * 1e3:.0f} ms: {met}"
    return line


@dataclass
class Samples:
    """Per-pod (or per-node) seconds, by stage, and what went otherwise than expected."""

    stages: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)

    def add(self, **stages: float) -> None:
        for name, seconds in stages.items():
            self.stages[name].append(seconds)


# --- the stack ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def dev_stack() -> AsyncIterator[DevContext]:
    """The stack as `kai-isolator dev` composes it (services/dev.py `run`), started until the block ends."""
    settings = load(BusSettings)
    async with bus_url(settings) as url, contextlib.AsyncExitStack() as stack:
        await _provision(url, settings)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kai-isolator-e2e-")))
        ctx = DevContext(nats_url=url, bus=settings.model_copy(update={"nats_url": url}), workdir=workdir, nats_embedded=settings.nats_url is None)
        for component in registry.dev_components():
            await stack.enter_async_context(component(ctx))
        yield ctx


async def webhook_serving(cluster: DevCluster, values: dict[str, Any], timeout_s: float = STEP_TIMEOUT_S) -> None:
    """Until a created GPU-sharing pod comes back injected: the registration is live in the API server (not timed)."""
    deadline = time.monotonic() + timeout_s
    while "webhook_registered" not in values:
        await asyncio.sleep(0.02)
    for attempt in itertools.count():
        pod = await cluster.create("pods", demo_pod(f"e2e-warmup-{attempt}", {}))
        await cluster.delete("pods", NAMESPACE, pod["metadata"]["name"], grace_period_s=0)
        if is_injected(pod):
            return
        if time.monotonic() > deadline:
            raise SystemExit("bench: the webhook never injected a pod")
        await asyncio.sleep(0.1)


def is_injected(pod: dict[str, Any]) -> bool:
    return any(v.get("name") == VGPU_VOLUME for v in (pod.get("spec") or {}).get("volumes") or [])


class Cleanup:
    """Pods (and their containers) removed CLEANUP_AFTER_S after their outcome, without holding up the next pod."""

    def __init__(self, cluster: DevCluster) -> None:
        self.cluster = cluster
        self.tasks: set[asyncio.Task[None]] = set()

    def later(self, namespace: str, name: str, container: ContainerProcess | None = None) -> None:
        task = asyncio.create_task(self._remove(namespace, name, container))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _remove(self, namespace: str, name: str, container: ContainerProcess | None) -> None:
        await asyncio.sleep(CLEANUP_AFTER_S)
        if container is not None:
            await container.stop()
        await self.cluster.delete("pods", namespace, name, grace_period_s=0)  # no kubelet confirms deletions in (a)

    async def drain(self) -> None:
        await asyncio.gather(*self.tasks)


async def in_flight(count: int, workers: int, one: Callable[[int], Awaitable[None]]) -> None:
    """Run `one(i)` for i in range(count), `workers` at a time."""
    queue = iter(range(count))

    async def worker() -> None:
        for index in queue:
            await one(index)

    await asyncio.gather(*(worker() for _ in range(min(workers, count))))


# --- (a) Running -> verified ----------------------------------------------------------------


class VerifiedRun:
    """(a): the bench as the node's kubelet, so Running is written only once the container runs."""

    def __init__(self, ctx: DevContext, clock: Clock) -> None:
        self.ctx = ctx
        self.cluster: DevCluster = ctx.values["dev_cluster"]
        self.clock = clock
        self.samples = Samples()
        self.placement = CgroupPlacement()
        self.scratch = ctx.workdir / "e2e"
        self.cleanup = Cleanup(self.cluster)

    async def run(self, pods: int, workers: int) -> Samples:
        kubelet = self.cluster.kubelets[NODE]
        # The simulated kubelet would report Running at once, with no process behind it; a real one reports
        # it after the runtime started the container. So it steps aside while the bench does its part.
        await kubelet.stop()
        try:
            await in_flight(pods, workers, self.one_pod)
            await self.cleanup.drain()
        finally:
            await kubelet.start()
            await asyncio.to_thread(self.placement.remove)
        return self.samples

    async def one_pod(self, index: int) -> None:
        name = f"e2e-gpu-{index}"
        pod = await self.cluster.create("pods", demo_pod(name, {}))
        uid = pod["metadata"]["uid"]
        container: ContainerProcess | None = None
        try:
            await self.clock.wait(("grant", uid))  # bound, and the node agent wrote the grant: well before a kubelet starts it
            container = await self.start(name)
            status = running_status(await self.cluster.get("pods", NAMESPACE, name))
            for entry in status["containerStatuses"]:
                entry["containerID"] = f"containerd://{container.container_id}"
            await self.cluster.patch("pods", NAMESPACE, name, {"status": status}, content_type=STRATEGIC_MERGE_PATCH, subresource="status")
            committed = time.perf_counter()
            running_at, _ = await self.clock.wait(("pod", uid, "running"))
            verdict_at, verdict = await self.clock.wait(("verdict", uid))
            self.samples.add(total=verdict_at - committed, watcher=running_at - committed, verifier=verdict_at - running_at)
            self.samples.outcomes[verdict.verdict + ("" if verdict.verdict == "verified" else f" ({','.join(r.code for r in verdict.reasons)})")] += 1
            if not any(v.get("name") == GRANT_VOLUME for v in pod["spec"].get("volumes") or []):
                self.samples.outcomes["admitted without the grant volume"] += 1
        except (StepTimeout, IsolatorError, asyncio.TimeoutError) as error:
            self.samples.outcomes[f"failed: {type(error).__name__}: {str(error)[:80]}"] += 1
        finally:
            self.cleanup.later(NAMESPACE, name, container)

    async def start(self, name: str) -> ContainerProcess:
        """The container as its runtime starts it, returned once its program made its first allocation."""
        pod = await self.cluster.get("pods", NAMESPACE, name)
        spec = pod["spec"]["containers"][0]
        container = await start_container(
            pod, spec, CONTAINER_ARGV, configmaps=await self.configmaps(spec), host_root=Path(self.ctx.values["host_root"]),
            scratch=self.scratch / name, extra_env={"LD_LIBRARY_PATH": str(HAMI_BUILD / "fake"), **self.ctx.values.get("fake_driver_env", {})},
            placement=self.placement)
        try:
            for command in CONTAINER_READY:
                line = await container.read_line()
                if line.split()[0] != command or "rc=0" not in line.split():
                    raise StepTimeout(f"the container's program printed {line!r} for its {command}")
        except BaseException:
            await container.stop()
            raise
        return container

    async def configmaps(self, container: dict[str, Any]) -> dict[str, dict[str, str]]:
        names = {ref["name"] for e in container.get("env") or [] if (ref := (e.get("valueFrom") or {}).get("configMapKeyRef"))}
        return {n: (await self.cluster.get("configmaps", NAMESPACE, n)).get("data") or {} for n in names}


# --- (b) admitted without injection -> Warning Event ------------------------------------------


async def missing_run(ctx: DevContext, clock: Clock, pods: int, workers: int) -> Samples:
    """(b): half the pods opt out by annotation, half by their namespace; the simulated kubelet runs them."""
    cluster: DevCluster = ctx.values["dev_cluster"]
    await cluster.ensure_namespace(OPTED_OUT_NAMESPACE, labels=OPT_OUT_LABEL)
    samples = Samples()
    cleanup = Cleanup(cluster)

    async def one_pod(index: int) -> None:
        by_namespace = index % 2 == 1
        body = demo_pod(f"e2e-missing-{index}", {} if by_namespace else {INJECT_ANNOTATION: "false"})
        namespace = OPTED_OUT_NAMESPACE if by_namespace else NAMESPACE
        body["metadata"]["namespace"] = namespace
        pod = await cluster.create("pods", body)
        admitted = time.perf_counter()
        uid = pod["metadata"]["uid"]
        try:
            if is_injected(pod):
                samples.outcomes["injected after all"] += 1
            scheduled_at, _ = await clock.wait(("pod", uid, "scheduled"))
            running_at, _ = await clock.wait(("pod", uid, "running"))
            verdict_at, _ = await clock.wait(("verdict", uid))
            warning_at, event = await clock.wait(("warning", uid))
            kind = "namespace" if by_namespace else "annotation"
            samples.add(total=warning_at - admitted, **{f"total_{kind}": warning_at - admitted}, scheduled=scheduled_at - admitted,
                        running=running_at - scheduled_at, verdict=verdict_at - running_at, event=warning_at - verdict_at)
            samples.outcomes[f"{event.get('reason')} ({kind})"] += 1
        except StepTimeout as error:
            samples.outcomes[f"timed out: {error}"] += 1
        finally:
            cleanup.later(namespace, pod["metadata"]["name"])

    await in_flight(pods, workers, one_pod)
    await cleanup.drain()
    return samples


# --- (c) new node -> ready --------------------------------------------------------------------


async def new_node_run(ctx: DevContext, clock: Clock, nodes: int) -> Samples:
    """(c): one node at a time, registered, then its node agent (the dev component) started and stopped."""
    cluster: DevCluster = ctx.values["dev_cluster"]
    samples = Samples()
    for index in range(nodes):
        node = f"e2e-node-{index}"
        await cluster.add_node(node)
        node_ctx = dataclasses.replace(ctx, values={**ctx.values, "node_name": node})
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the component's banner, once per node
            async with nodeagent_dev.component(node_ctx):
                returned = time.perf_counter()
                try:
                    ready_at, status = await clock.wait(("ready", node))
                except StepTimeout as error:
                    samples.outcomes[f"timed out: {error}"] += 1
                    continue
                samples.add(total=ready_at - started, started=returned - started)
                samples.outcomes[f"ready, self-check {status.self_check}, version {status.active_version}"] += 1
    return samples


# --- report ---------------------------------------------------------------------------------


def report_verified(samples: Samples, pods: int, workers: int, cpu: str) -> None:
    print(f"(a) GPU-sharing pod Running -> `verified` on the bus: {pods} pods, {workers} in flight")
    print(latency_line("Running status written -> verdict", samples.stages["total"], GOAL_VERIFIED_P99_S))
    print(latency_line("  of which -> `running` event (watcher)", samples.stages["watcher"]))
    print(latency_line("  of which -> verdict (verifier + node agent)", samples.stages["verifier"]))
    print(f"    outcomes: {dict(samples.outcomes)}")
    print(f"    CPU per pod: {cpu}")


def report_missing(samples: Samples, pods: int, workers: int, cpu: str) -> None:
    print(f"(b) pod admitted without injection -> Warning Event in the API: {pods} pods, {workers} in flight")
    print(latency_line("create answered -> Warning Event (watch)", samples.stages["total"], GOAL_WARNING_P99_S))
    print(latency_line("  opted out by annotation", samples.stages["total_annotation"]))
    print(latency_line("  opted out by namespace (webhook not called)", samples.stages["total_namespace"]))
    print(latency_line("  stage: -> `scheduled` (KAI sim, 0.2 s step)", samples.stages["scheduled"]))
    print(latency_line("  stage: -> `running` (kubelet sim, 0.2 s step)", samples.stages["running"]))
    print(latency_line("  stage: -> `missing` verdict (verifier)", samples.stages["verdict"]))
    print(latency_line("  stage: -> Event seen on the watch", samples.stages["event"]))
    print(f"    outcomes: {dict(samples.outcomes)}")
    print(f"    CPU per pod: {cpu}")


def report_new_node(samples: Samples, nodes: int) -> None:
    print(f"(c) new node: node agent started -> ready + self-check passed on the bus: {nodes} nodes, one at a time")
    print(latency_line("agent start -> NodeStatus ready", samples.stages["total"]))
    print(latency_line("  of which the agent's start() (install, self-check, publish)", samples.stages["started"]))
    print(f"    outcomes: {dict(samples.outcomes)}")


async def bench(args: argparse.Namespace, warnings: WarningCounter) -> None:
    setup = time.perf_counter()
    clock = Clock()
    async with dev_stack() as ctx:  # its components print their banners
        cluster: DevCluster = ctx.values["dev_cluster"]
        async with watching_bus(ctx.nats_url, clock), watching_warnings(cluster, clock):
            await webhook_serving(cluster, ctx.values)
            assert cluster.plane is not None
            print(f"\ne2e bench: the dev stack in one process on {os.cpu_count()} cores (kube-apiserver {cluster.plane.binaries.kube_version}, "
                  f"{ctx.nats_description}), up in {time.perf_counter() - setup:.1f} s", flush=True)
            if args.pods:
                cpu = CpuMeter()
                verified = await VerifiedRun(ctx, clock).run(args.pods, args.in_flight)
                report_verified(verified, args.pods, args.in_flight, cpu.per_item_ms(args.pods))
            if args.missing_pods:
                cpu = CpuMeter()
                missing = await missing_run(ctx, clock, args.missing_pods, args.in_flight)
                report_missing(missing, args.missing_pods, args.in_flight, cpu.per_item_ms(args.missing_pods))
            if args.nodes:
                report_new_node(await new_node_run(ctx, clock, args.nodes), args.nodes)
    total = sum(warnings.counts.values())
    print(f"stack warnings logged: {total}" + "".join(f"\n    {n:4d}x {what}" for what, n in warnings.counts.most_common(5)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=200, help="GPU-sharing pods for (a)")
    parser.add_argument("--missing-pods", type=int, default=100, help="pods admitted without injection for (b)")
    parser.add_argument("--nodes", type=int, default=5, help="new nodes for (c); 0 skips it")
    parser.add_argument("--in-flight", type=int, default=4, help="pods in flight at once in (a) and (b)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="error",
                        help="the stack's log lines shown (warnings are counted either way)")
    parser.add_argument("--profile", type=Path, help="cProfile the whole run (the stack's event loop included) into this file; prints the top")
    args = parser.parse_args()
    logs.configure(LogSettings(log_level=args.log_level))
    root = logging.getLogger()
    root.handlers[0].setLevel(args.log_level.upper())  # what is shown ...
    root.setLevel(min(root.handlers[0].level, logging.WARNING))  # ... while every warning still reaches the counter
    warnings = WarningCounter()
    root.addHandler(warnings)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    try:
        asyncio.run(bench(args, warnings))
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(args.profile))
            pstats.Stats(str(args.profile)).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
