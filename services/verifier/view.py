"""The node view the verifier keeps on each GPU Node for operators: the agent's last status and its
containers' grant and usage, from the bus, written as one annotation (`shared/operator_view.py`).

Writes are throttled: a node's annotation is written when its content changed, and otherwise once per
heartbeat so `last seen` stays honest, never once per report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from kai_isolator.shared.events import NodeStatus, UsageReport
from kai_isolator.shared.operator_view import ContainerUsageView, NodeAgentView

from .kube import PodNotifier

log = logging.getLogger(__name__)


class NodeViews:
    """Latest status and usage per node, flushed to the Nodes by `flush()`."""

    def __init__(self, notifier: PodNotifier, *, heartbeat_s: float = 60.0, usage_stale_s: float = 300.0) -> None:
        self.notifier = notifier
        self.heartbeat_s = heartbeat_s
        self.usage_stale = timedelta(seconds=usage_stale_s)
        self._status: dict[str, tuple[NodeStatus, datetime]] = {}
        self._usage: dict[str, dict[tuple[str, str], ContainerUsageView]] = {}
        self._written: dict[str, tuple[str, float]] = {}  # node -> (content, monotonic time written)

    def on_status(self, status: NodeStatus) -> None:
        self._status[status.node_name] = (status, datetime.now(timezone.utc))

    def on_usage(self, report: UsageReport) -> None:
        limited = [d.limit_bytes for d in report.devices if not d.unlimited]
        grant = sum(limited) if limited and len(limited) == len(report.devices) else None
        row = ContainerUsageView(namespace=report.pod.namespace, pod=report.pod.name, uid=report.pod.uid, container=report.container,
                                 grant_bytes=grant, used_bytes=sum(d.used_bytes for d in report.devices), source=report.source,
                                 sampled_at=report.sampled_at)
        self._usage.setdefault(report.node_name, {})[(report.pod.uid or report.pod.name, report.container)] = row

    def forget_pod(self, uid: str) -> None:
        for rows in self._usage.values():
            for key in [k for k in rows if k[0] == uid]:
                del rows[key]

    def view(self, node: str) -> NodeAgentView | None:
        if node not in self._status:
            return None
        status, seen = self._status[node]
        cutoff = datetime.now(timezone.utc) - self.usage_stale
        rows = sorted((r for r in self._usage.get(node, {}).values() if r.sampled_at >= cutoff), key=lambda r: (r.namespace, r.pod, r.container))
        return NodeAgentView(
            node=node, last_seen=seen, ready=status.ready, active_version=status.active_version,
            staged_versions=[v for v in status.installed_versions if v != status.active_version], self_check=status.self_check,
            enforcer=status.enforcer, mode=status.mode, problems=list(status.problems), gpu_count=status.gpu_count, containers=rows)

    async def flush(self) -> int:
        """Write each node whose view changed or whose heartbeat is due; the number written."""
        written = 0
        for node in list(self._status):
            view = self.view(node)
            if view is None:
                continue
            content, at = self._written.get(node, ("", 0.0))
            if content == view.content() and time.monotonic() - at < self.heartbeat_s:
                continue
            if await self.notifier.annotate_node(view):
                self._written[node] = (view.content(), time.monotonic())
                written += 1
        return written

    async def flush_forever(self, interval_s: float, leading: Callable[[], bool] = lambda: True) -> None:
        """Flush every `interval_s` while `leading()`: of several replicas, one writes the Nodes."""
        while True:
            await asyncio.sleep(interval_s)
            if not leading():
                self._written.clear()  # when leading again, write every view once: another replica wrote meanwhile
                continue
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - one failed round must not end the node views for good
                log.exception("writing node views failed; retrying next round")
