"""The node agent service: answers inspect and install requests for its node, keeps the
library installed and self-checked, holds every container to its grant from the driver's
view (the enforcer), and reports status and per-container usage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kai_isolator.shared import kube_events, subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError, ConfigError, IsolatorError
from kai_isolator.shared.events import (
    Breach, DeviceUsage, DriverCap, InspectReply, InspectRequest, InstallReply, InstallRequest, NodeStatus, PodIsolation, PodRef,
    ProcessUsage, Reason, UsageReport,
)
from kai_isolator.shared.settings import BusSettings
from kai_isolator.shared.tasks import cancel_all

from . import creation, enforce, grants, install, nvml, observe
from .layout import HostLayout
from .settings import NODE_BUCKET, NodeAgentSettings

log = logging.getLogger(__name__)
SERVICE = "nodeagent"
COMPONENT = "kai-isolator-nodeagent"
_LABELS = ["zone", "namespace", "pod", "container", "vdevice_index", "device_uuid"]


class UsageCollector(Collector):
    """Per-container gauges with HAMi's names and labels, from the latest usage scan."""

    def __init__(self) -> None:
        self.rows: list[tuple[PodRef, observe.ContainerUsage]] = []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        used = GaugeMetricFamily("hami_vgpu_memory_used_bytes", "vGPU device memory used by the container", labels=_LABELS)
        limit = GaugeMetricFamily("hami_vgpu_memory_limit_bytes", "vGPU device memory limit of the container", labels=_LABELS)
        for pod, usage in self.rows:
            for device in usage.devices:
                labels = ["vGPU", pod.namespace, pod.name, usage.container, str(device.index), device.uuid[:40]]
                used.add_metric(labels, device.used_bytes)
                if not device.unlimited:
                    limit.add_metric(labels, device.limit_bytes)
        yield used
        yield limit


class NodeAgent:
    def __init__(self, settings: NodeAgentSettings, bus: BusSettings, probe_listen: str | None = None) -> None:
        if not settings.node_name:
            raise ConfigError("the node agent needs --node-name (or NODE_NAME)")
        self.settings = settings
        self.node = settings.node_name
        subjects.encode_token(self.node)
        self.layout = HostLayout(settings.host_root, settings.container_vgpu_mount)
        self.carried = {install.read_library(path)[1]: path for path in settings.library}
        self.default_version = install.read_library(settings.library[0])[1] if settings.library else None
        self.runtime = Runtime(SERVICE, bus, kv_buckets=[NODE_BUCKET], probe_listen=probe_listen)
        self.runtime.on_request(subjects.node_inspect(self.node), self.on_inspect)
        self.runtime.on_request(subjects.node_install(self.node), self.on_install)
        self.runtime.on_event(f"pods-{self.node.replace('.', '_')}", subjects.ALL_PODS, self.on_pod)
        self.pods: dict[str, PodRef] = {}
        self.usage = UsageCollector()
        self.runtime.metrics.registry.register(self.usage)
        self.self_check_gauge = Gauge("kai_isolator_nodeagent_self_check_passed", "1 when the last self-check passed", registry=self.runtime.metrics.registry)
        self.last_check: observe.SelfCheck | None = None
        self._sequence = time.time_ns() // 1000  # survives restarts without reusing a de-duplication id
        self._lock = asyncio.Lock()
        self._loops: list[asyncio.Task[None]] = []
        self.grant_root = settings.host_root / settings.grant_dir.lstrip("/")
        self.grants: grants.GrantKeeper | None = None
        self.api: object | None = None
        registry = self.runtime.metrics.registry
        self.breaches = Counter("kai_isolator_breaches", "Containers found above their grant by the driver's view, by action",
                                ["namespace", "pod", "container", "action"], registry=registry)
        self.nvml_up = Gauge("kai_isolator_nvml_up", "1 while the enforcer's last NVML poll was complete", registry=registry)
        self.unattributed = Gauge("kai_isolator_gpu_processes_unattributed", "Processes holding device memory that the enforcer "
                                  "judges against no grant: outside every pod the agent knows, or of a pod outside GPU sharing on a "
                                  "GPU KAI does not share (reported, never touched)", registry=registry)
        self.poll_seconds = Histogram("kai_isolator_enforcer_poll_seconds", "One enforcer round: NVML snapshot, attribution, "
                                      "comparison, action", registry=registry, buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        self._nvml: nvml.Nvml | None = None
        self.mode = creation.NodeMode.LIBRARY_AND_ENFORCER  # without NRI: today's path
        self._creation_server: asyncio.AbstractServer | None = None
        self._gate: creation.CreationGate | None = None
        self.mode_gauge = Gauge("kai_isolator_node_mode", "1 for the way this node holds grants: driver-capped (R615+, cgroup v2, "
                                "NRI) or library-and-enforcer", ["mode"], registry=registry)
        self.mode_gauge.labels(mode=self.mode.value).set(1)
        self.enforcer: enforce.Enforcer | None = None
        if settings.enforce:
            pods = enforce.KnownPods(self.grant_root, self._known_pods, self._withheld, others=self._other_pods, shared=self._shared_gpus)
            self.enforcer = make_enforcer(settings, self._snapshot, pods, self._report_breach, self._evict)
            self.runtime.add_readiness_check(self._enforcer_problem)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self, url: str) -> None:
        api = await grants.api_client(self.settings.kubeconfig)  # a broken configuration stops the agent before it serves
        self.api = api
        await self.runtime.start(url)
        if self.settings.install_on_start and self.default_version and install.active_version(self.layout) is None:
            async with self._lock:
                await asyncio.to_thread(install.activate, self.layout, self.default_version, self.carried)
            log.info("installed the carried library", extra={"node": self.node, "version": self.default_version})
        await self.refresh()
        self._loops = [
            asyncio.create_task(self._every(self.settings.status_interval_s, self.refresh), name="status"),
            asyncio.create_task(self._every(self.settings.usage_interval_s, self.report_usage), name="usage"),
        ]
        if api is None:
            log.warning("no Kubernetes API (no --kubeconfig, not in a cluster): no grants are written, no container is enforced",
                        extra={"node": self.node})
        else:
            self.grants = grants.GrantKeeper(api, self.node, self.grant_root, self.runtime.publish, on_withheld=self._post_withheld,
                                             reservation_namespace=self.settings.reservation_namespace)
            self._loops.append(asyncio.create_task(self.grants.run(), name="grants"))
        if self.enforcer is not None:
            self._loops.append(asyncio.create_task(self._enforce(), name="enforcer"))
        if self.settings.nri_socket is not None:
            await self._serve_creation(self.settings.nri_socket)

    async def stop(self) -> None:
        await cancel_all(self._loops)
        if self._creation_server is not None:
            self._creation_server.close()
        if self.grants is not None:
            await self.grants.close()
        if self._nvml is not None:
            self._nvml.close()
        await self.runtime.stop()

    async def _every(self, period: float, action: object) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await action()  # type: ignore[operator]
            except Exception:  # noqa: BLE001 - a failed round is logged; the next one retries
                log.exception("periodic node agent task failed", extra={"node": self.node})

    # --- status --------------------------------------------------------------------------

    async def refresh(self) -> NodeStatus:
        """GC retired versions, self-check, then publish the node's status and store it in KV."""
        async with self._lock:
            removed, _ = await asyncio.to_thread(install.collect_garbage, self.layout, self.settings.proc_root, self.settings.gc_grace_s)
            if removed:
                log.info("removed library versions no process maps", extra={"node": self.node, "versions": removed})
            self.last_check = await asyncio.to_thread(observe.self_check, self.layout, self.settings.self_check_command, self.settings.self_check_timeout_s)
            state = await asyncio.to_thread(install.status, self.layout)
        self.self_check_gauge.set(1 if self.last_check.passed else 0)
        self._sequence += 1
        report = NodeStatus(
            node_name=self.node, sequence=self._sequence, ready=state.installed and self.last_check.passed,
            active_version=state.active_version, installed_versions=state.installed_versions,
            container_vgpu_mount=self.layout.mount, gpu_count=state.gpu_count, message=self.last_check.message,
            self_check="passed" if self.last_check.passed else "failed", self_check_at=self.last_check.at,
            problems=state.problems, enforcer_problem=self._enforcer_problem() or "",
            enforcer="off" if self.enforcer is None else "enforcing" if self.enforcer.healthy else "blind",
            mode=self.mode.value,
        )
        try:
            await self.runtime.kv(NODE_BUCKET).put(self.node, report.model_dump_json().encode())
            await self.runtime.publish(report)
        except Exception as error:  # noqa: BLE001 - the bus being away must not stop the agent
            log.warning("could not report node status", extra={"node": self.node, "error": repr(error)})
        return report

    # --- handlers ------------------------------------------------------------------------

    async def on_install(self, request: InstallRequest) -> InstallReply:
        if request.node_name != self.node:
            return InstallReply(node_name=self.node, version=request.version, ok=False, message=f"this is {self.node}, not {request.node_name}")
        try:
            async with self._lock:
                await asyncio.to_thread(install.activate, self.layout, request.version, self.carried)
        except IsolatorError as error:
            await self.refresh()
            return InstallReply(node_name=self.node, version=request.version, ok=False,
                                active_version=install.active_version(self.layout), message=str(error))
        report = await self.refresh()
        ok = report.active_version == request.version and report.self_check == "passed"
        log.info("install request handled", extra={"node": self.node, "version": request.version, "ok": ok})
        return InstallReply(node_name=self.node, version=request.version, ok=ok, active_version=report.active_version, message=report.message)

    async def on_inspect(self, request: InspectRequest) -> InspectReply:
        active = install.active_version(self.layout)
        try:
            reply = await asyncio.wait_for(
                asyncio.to_thread(observe.reply_to, self.layout, self.settings.proc_root, request, self.node, active),
                self.settings.inspect_timeout_s,
            )
            devices = enforce.driver_devices(self.enforcer, request.pod.uid, request.container, self._fresh_s())
            reply = enforce.with_driver_view(reply, self._driver_memory(), devices)
            return reply.model_copy(update={"driver_caps": await asyncio.to_thread(self._caps_held, reply)})
        except asyncio.TimeoutError:
            return InspectReply(node_name=self.node, pod=request.pod, container=request.container, found=False, installed_version=active,
                                message=f"inspection took longer than {self.settings.inspect_timeout_s}s")

    async def on_pod(self, event: PodIsolation) -> None:
        """Learn which pod a `<uid>_<container>` state directory belongs to (for usage labels)."""
        if event.node_name != self.node or not event.pod.uid:
            return
        if event.state in ("finished", "deleted"):
            self.pods.pop(event.pod.uid, None)
        else:
            self.pods[event.pod.uid] = event.pod

    async def report_usage(self) -> list[UsageReport]:
        """Per-container usage: from the driver's view when the enforcer has a fresh complete one (the
        usage.cache then only flags itself when it disagrees), else from the usage.cache."""
        scanned = await asyncio.to_thread(observe.scan_usage, self.layout)
        poll = self.enforcer.last if self.enforcer is not None else None
        fresh = enforce.driver_memory(poll, self._fresh_s()) is not None
        reports: list[UsageReport] = []
        rows: list[tuple[PodRef, observe.ContainerUsage]] = []
        if fresh and poll is not None:
            for pod, usage, reasons in driver_usage(poll, scanned, self.pods, self.settings.breach_tolerance_mib << 20):
                rows.append((pod, usage))
                reports.append(UsageReport(pod=pod, node_name=self.node, container=usage.container, devices=usage.devices,
                                           processes=usage.processes, source="driver", reasons=reasons))
        else:
            rows = [(self.pods[u.pod_uid], u) for u in scanned if u.pod_uid in self.pods]
            reports = [UsageReport(pod=pod, node_name=self.node, container=u.container, devices=u.devices, processes=u.processes) for pod, u in rows]
        self.usage.rows = rows
        for report in reports:
            try:
                await self.runtime.publish(report)
            except BusError as error:
                log.warning("could not publish usage", extra={"node": self.node, "error": str(error)})
        return reports

    # --- container creation (NRI) -------------------------------------------------------------

    def _caps_held(self, reply: InspectReply) -> list[DriverCap]:
        """The driver's cap on the container's leaf, read back for the verifier (any of its processes names the leaf)."""
        if self._gate is None or not reply.processes:
            return []
        held = self._gate.caps_held(reply.pod.uid, reply.container, reply.processes[0].pid)
        return [DriverCap(uuid=uuid, hard_bytes=hard) for uuid, hard in sorted(held.items())]

    async def _serve_creation(self, path: object) -> None:
        """The decision socket the NRI plugin asks; the node's mode is decided once, from the driver and the kernel."""
        mount = creation.v2_mount()
        driver: nvml.Nvml | None = None
        try:
            driver = await asyncio.to_thread(nvml.Nvml, self.settings.nvml_library)
        except nvml.NvmlError as error:
            log.warning("no NVML for the driver's cap", extra={"node": self.node, "error": str(error)})
        namespace = "/"
        if mount is not None:
            try:
                namespace = await asyncio.to_thread(creation.namespace_root, mount, self.settings.proc_root)
            except creation.CreationError as error:
                log.warning("cannot place this agent's cgroup namespace; the library and the enforcer hold", extra={"error": str(error)})
                mount = None
        self.mode = await asyncio.to_thread(creation.detect_mode, driver, mount)
        self.mode_gauge.clear()
        self.mode_gauge.labels(mode=self.mode.value).set(1)
        gate = creation.CreationGate(self.grant_root, self.mode, driver=driver, mount=mount, proc_root=self.settings.proc_root,
                                     namespace=namespace, hold_s=self.settings.nri_hold_s)
        self._gate = gate  # inspect reads the driver's cap back through it
        self._creation_server = await creation.serve(gate, path)  # type: ignore[arg-type]
        log.info("taking part in container creation", extra={"node": self.node, "mode": self.mode.value, "socket": str(path),
                                                              "cgroup_namespace": namespace})

    # --- the enforcer ----------------------------------------------------------------------

    def _snapshot(self) -> nvml.DriverSnapshot:
        """Runs in a worker thread. NVML is loaded on first use and again after a failed load (a
        driver installed after the agent started), so one missing library never needs a restart."""
        if self._nvml is None:
            self._nvml = nvml.Nvml(self.settings.nvml_library)
        return self._nvml.snapshot()

    def _known_pods(self) -> dict[str, dict[str, object]]:
        return {uid: tracked.pod for uid, tracked in self.grants.pods.items()} if self.grants is not None else {}

    def _other_pods(self) -> dict[str, dict[str, object]]:
        return self.grants.others if self.grants is not None else {}

    def _shared_gpus(self) -> frozenset[str]:
        return self.grants.shared_gpus() if self.grants is not None else frozenset()

    def _withheld(self, pod_uid: str, container: str) -> str | None:
        return self.grants.withheld.get((pod_uid, container)) if self.grants is not None else None

    async def _post_withheld(self, pod: PodRef, container: str, reasons: str, key: str) -> None:
        """A withheld grant, written on the pod: the enforcer holds the container to nothing until one is written."""
        if self.api is not None:
            await kube_events.post_event(self.api, pod, reason="GrantWithheld", kind="Warning", key=key, component=COMPONENT,  # type: ignore[arg-type]
                                         message=f"container {container} is granted no GPU memory, and the node agent kills what it "
                                                 f"holds: {reasons}", container=container)

    def _fresh_s(self) -> float:
        return 3 * self.settings.enforce_interval_s + 1

    def _driver_memory(self) -> dict[int, int] | None:
        return enforce.driver_memory(self.enforcer.last if self.enforcer is not None else None, self._fresh_s())

    def _enforcer_problem(self) -> str | None:
        """What keeps the enforcer from acting, for /readyz and the node status; None while it sees everything."""
        if self.enforcer is None:
            return None
        last = self.enforcer.last
        if last is None:
            return "enforcer: no NVML poll yet"
        if not last.ok:
            return f"enforcer blind, nothing is enforced: {last.error}"
        if self.api is None:
            return "enforcer: no Kubernetes API, so no container can be attributed or enforced"
        return None

    async def _enforce(self) -> None:
        assert self.enforcer is not None
        reported = ""
        while True:
            began = time.monotonic()
            try:
                poll = await self.enforcer.poll()
                self.nvml_up.set(1 if poll.ok else 0)
                self.unattributed.set(len({u.pid for u in poll.unattributed}))
                self.poll_seconds.observe(poll.seconds)
                if poll.error != reported:  # say it once, when it starts and when it changes
                    (log.error if poll.error else log.info)("enforcer: %s", poll.error or "NVML answers; enforcing", extra={"node": self.node})
                    reported = poll.error
            except Exception:  # noqa: BLE001 - the enforcer must keep running
                log.exception("enforcer round failed", extra={"node": self.node})
            await asyncio.sleep(self.enforcer.next_poll_in(self.settings.enforce_interval_s, time.monotonic() - began))

    async def _report_breach(self, target: enforce.Target, breach: Breach) -> None:
        """One breach, told once: the `breached` verdict, the IsolationBreached Event, the counter."""
        self.breaches.labels(target.pod.namespace, target.pod.name, target.container, breach.action).inc()
        log.warning("isolation breached", extra={"node": self.node, "pod": f"{target.pod.namespace}/{target.pod.name}",
                                                  "container": target.container, "device": breach.device_uuid, "action": breach.action,
                                                  "measured_bytes": breach.measured_bytes, "grant_bytes": breach.grant_bytes})
        try:
            await self.runtime.publish(enforce.verdict(self.node, target, breach))
        except BusError as error:
            log.warning("could not publish the breach verdict", extra={"node": self.node, "error": str(error)})
        if self.api is not None:
            await kube_events.post_event(self.api, target.pod, reason="IsolationBreached", kind="Warning",  # type: ignore[arg-type]
                                         message=enforce.event_message(target, breach), key=f"breach-{breach.breach_id}",
                                         component=COMPONENT, container=target.container)

    async def _evict(self, pod: PodRef) -> bool:
        if self.api is None:
            return False
        return await kube_events.evict(self.api, pod)  # type: ignore[arg-type]


def make_enforcer(settings: NodeAgentSettings, snapshot: enforce.Snapshot, pods: enforce.KnownPods, report: enforce.Report,
                  evict: enforce.Evict | None) -> enforce.Enforcer:
    """The enforcer as the agent runs it, from its settings (the security tests build the shipped one with this)."""
    return enforce.Enforcer(snapshot, pods, report, proc_root=settings.proc_root, on_breach=settings.on_breach,
                            tolerance_bytes=settings.breach_tolerance_mib << 20, evict=evict)


def driver_usage(poll: enforce.Poll, scanned: list[observe.ContainerUsage], pods: dict[str, PodRef],
                 tolerance: int) -> list[tuple[PodRef, observe.ContainerUsage, list[Reason]]]:
    """Each container's usage from the driver's view, with `usage-cache-disagrees` where its usage.cache
    shows more than the driver holds, or the driver holds more than the cache plus context reservations."""
    caches = {(u.pod_uid, u.container): u for u in scanned}
    found: dict[tuple[str, str], tuple[PodRef, dict[str, enforce.Measure]]] = {}
    for measure in poll.measures:
        found.setdefault(measure.target.key, (measure.target.pod, {}))[1][measure.device_uuid] = measure
    rows = []
    for key, (pod, measures) in found.items():
        devices, processes, reasons = [], [], []
        cache = caches.get(key)
        for index, uuid in enumerate(poll.devices):
            measure = measures.get(uuid)
            if measure is None:
                continue
            devices.append(DeviceUsage(index=index, uuid=uuid, limit_bytes=measure.limit_bytes, used_bytes=measure.used_bytes))
            processes += [ProcessUsage(pid=p.identity.pid, device=index, used_bytes=p.used_bytes or 0) for p in measure.processes]
            cached = sum(d.used_bytes for d in (cache.devices if cache else []) if d.uuid == uuid or (not d.uuid and d.index == index))
            if cached > measure.used_bytes or measure.used_bytes > cached + tolerance:
                reasons.append(Reason(code="usage-cache-disagrees", message=f"device {uuid}: usage.cache shows {cached} bytes, "
                                                                            f"the driver {measure.used_bytes}"))
        rows.append((pod, observe.ContainerUsage(key[0], key[1], devices, processes), reasons))
    # Containers the driver shows nothing for, whose cache claims memory: the cache is wrong.
    for key, cache in caches.items():
        if key in found or key[0] not in pods:
            continue
        held = sum(d.used_bytes for d in cache.devices)
        reasons = [Reason(code="usage-cache-disagrees", message=f"usage.cache shows {held} bytes, the driver none")] if held else []
        devices = [d.model_copy(update={"used_bytes": 0}) for d in cache.devices]
        rows.append((pods[key[0]], observe.ContainerUsage(key[0], key[1], devices, []), reasons))
    return rows
