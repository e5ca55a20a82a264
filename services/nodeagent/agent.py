"""The node agent service: answers inspect and install requests for its node, keeps the
library installed and self-checked, and reports status and per-container usage."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from prometheus_client import Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError, ConfigError, IsolatorError
from kai_isolator.shared.events import (
    InspectReply, InspectRequest, InstallReply, InstallRequest, NodeStatus, PodIsolation, PodRef, UsageReport,
)
from kai_isolator.shared.settings import BusSettings

from . import grants, install, observe
from .layout import HostLayout
from .settings import NODE_BUCKET, NodeAgentSettings

log = logging.getLogger(__name__)
SERVICE = "nodeagent"
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

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self, url: str) -> None:
        api = await grants.api_client(self.settings.kubeconfig)  # a broken configuration stops the agent before it serves
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
            log.warning("no Kubernetes API (no --kubeconfig, not in a cluster): no grants are written", extra={"node": self.node})
        else:
            self.grants = grants.GrantKeeper(api, self.node, self.grant_root, self.runtime.publish)
            self._loops.append(asyncio.create_task(self.grants.run(), name="grants"))

    async def stop(self) -> None:
        for task in self._loops:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.grants is not None:
            await self.grants.close()
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
            problems=state.problems,
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
            return await asyncio.wait_for(
                asyncio.to_thread(observe.reply_to, self.layout, self.settings.proc_root, request, self.node, active),
                self.settings.inspect_timeout_s,
            )
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
        scanned = await asyncio.to_thread(observe.scan_usage, self.layout)
        rows = [(self.pods[u.pod_uid], u) for u in scanned if u.pod_uid in self.pods]
        self.usage.rows = rows
        reports = [UsageReport(pod=pod, node_name=self.node, container=u.container, devices=u.devices, processes=u.processes) for pod, u in rows]
        for report in reports:
            try:
                await self.runtime.publish(report)
            except BusError as error:
                log.warning("could not publish usage", extra={"node": self.node, "error": str(error)})
        return reports
