"""What the control plane writes into the Kubernetes API for operators (read by `kubectl isolator`): the pod
condition `kai-resource-isolator.io/Isolated` and the node annotation with the node agent's view of its node.

Both live where tenants cannot write (the pod `status` subresource, the Node object), so nothing a tenant
puts in its own pod's annotations or ConfigMaps can make a container look isolated.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from .events import Verdict

ISOLATED_CONDITION = "kai-resource-isolator.io/Isolated"
NODE_VIEW_ANNOTATION = "kai-resource-isolator.io/node-agent"
VERDICTS: tuple[Verdict, ...] = ("verified", "degraded", "missing", "breached")
# Event reasons our services post on pods, in the order an isolation story tells them.
EVENT_REASONS = {"IsolationVerified": "verified", "IsolationDegraded": "degraded", "IsolationMissing": "missing",
                 "IsolationBreached": "breached"}


def condition_message(verdict: Verdict, container: str, reasons: list[tuple[str, str]]) -> str:
    """`<verdict>: container <c>[: <code>: <message>; ...]`: the verdict word first, so a reader needs no mapping
    from reason codes to verdicts (the condition's status is only True/False)."""
    text = f"{verdict}: container {container}"
    if reasons:
        text += ": " + "; ".join(f"{code}: {message}" if message else code for code, message in reasons)
    return text[:1024]


def container_of_condition(message: str) -> str | None:
    """The container `condition_message` named (`<verdict>: container <c>[: ...]`), or None for a message we did not write."""
    _, sep, rest = message.partition(": container ")
    if not sep or verdict_of_condition(message) is None:
        return None
    return rest.split(": ", 1)[0] or None


def verdict_of_condition(message: str) -> Verdict | None:
    """The verdict word `condition_message` put first, or None for a message we did not write."""
    word = message.split(":", 1)[0].strip()
    for verdict in VERDICTS:
        if word == verdict:
            return verdict
    return None


class ContainerUsageView(BaseModel):
    """One GPU-sharing container on the node, from the agent's latest usage report."""

    namespace: str
    pod: str
    uid: str = ""
    container: str
    grant_bytes: int | None = Field(None, ge=0, description="sum of the per-device limits the node enforces; None: unlimited")
    used_bytes: int = Field(0, ge=0)
    source: str = Field("usage-cache", description="driver (NVML) or usage-cache")
    sampled_at: datetime


class NodeAgentView(BaseModel):
    """The node annotation's JSON: the agent's last status and its containers' usage."""

    node: str
    last_seen: datetime = Field(description="when the agent's last status report was received")
    ready: bool
    active_version: str | None = None
    staged_versions: list[str] = Field(default_factory=list, description="installed, not active")
    self_check: str = "not-run"
    enforcer: str = "off"
    mode: str = Field("library-and-enforcer", description="how the node holds grants (NodeStatus.mode): driver-capped or "
                                                          "library-and-enforcer")
    problems: list[str] = Field(default_factory=list)
    gpu_count: int = Field(0, ge=0)
    containers: list[ContainerUsageView] = Field(default_factory=list)

    def content(self) -> str:
        """Everything but the timestamps: a view whose content is unchanged needs no write before its heartbeat."""
        return self.model_dump_json(exclude={"last_seen": True, "containers": {"__all__": {"sampled_at"}}})
