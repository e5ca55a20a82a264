"""What `kubectl isolator` shows, built from API objects: one row per GPU-sharing container (and per container of any
other pod our services judged: one outside GPU sharing caught on a shared GPU), a pod's isolation story, one row per
GPU node. Pure functions over the JSON the API returned.

Trust: the verdict comes from the pod condition (status subresource) or our services' Events, grant and
usage from the node view on the Node; the pod's own annotations, env and ConfigMaps are the tenant's to
edit, so they are shown for what they claim and never decide a verdict.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from kai_isolator.shared.contract import (
    FRACTION_CONTAINER_ANNOTATION, GPU_FRACTION_ANNOTATION, GPU_MEMORY_ANNOTATION, INJECT_ANNOTATION, LIMIT_ENV, VGPU_VOLUME,
    is_gpu_sharing,
)
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.grant import GPU_MEMORY_NODE_LABEL
from kai_isolator.shared.limits import parse_limit
from kai_isolator.shared.operator_view import (
    EVENT_REASONS, ISOLATED_CONDITION, NODE_VIEW_ANNOTATION, ContainerUsageView, NodeAgentView, container_of_condition,
    verdict_of_condition,
)

Obj = dict[str, Any]
Shown = Literal["breached", "missing", "degraded", "pending", "verified"]
PROBLEMS = ("breached", "missing")
_ORDER = {"breached": 0, "missing": 1, "degraded": 2, "pending": 3, "verified": 4}
OUR_COMPONENTS = ("kai-isolator-verifier", "kai-isolator-nodeagent")
API_VERSION = "kai-resource-isolator.io/v1"
STALE_AGENT_S = 180.0  # three missed heartbeats of the verifier's node view


def parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


class ContainerRow(BaseModel):
    """`kubectl isolator status`: one GPU-sharing container."""

    namespace: str
    pod: str
    container: str
    node: str | None = None
    phase: str | None = None
    grant_bytes: int | None = Field(None, description="what the node enforces (node view); else what the pod's env claims")
    grant_from: Literal["node", "pod-env"] | None = None
    used_bytes: int | None = None
    usage_source: str | None = Field(None, description="driver (NVML) or usage-cache")
    verdict: Shown
    reason: str = ""
    message: str = ""
    verdict_from: Literal["condition", "event"] | None = None
    verdict_at: datetime | None = None
    requested: str = Field("", description="the pod's gpu-memory / gpu-fraction annotation, as the tenant wrote it")


class StatusList(BaseModel):
    apiVersion: str = API_VERSION
    kind: Literal["IsolationStatusList"] = "IsolationStatusList"
    items: list[ContainerRow]
    warnings: list[str] = Field(default_factory=list)


class StoryEntry(BaseModel):
    time: datetime | None = None
    what: str
    detail: str = ""
    kind: Literal["Normal", "Warning"] = "Normal"
    source: str = ""


class PodStory(BaseModel):
    apiVersion: str = API_VERSION
    kind: Literal["IsolationStory"] = "IsolationStory"
    namespace: str
    pod: str
    uid: str
    node: str | None = None
    containers: list[ContainerRow]
    story: list[StoryEntry]
    annotations: dict[str, str] = Field(default_factory=dict, description="the pod's isolation annotations (tenant-writable)")
    warnings: list[str] = Field(default_factory=list)


class NodeRow(BaseModel):
    node: str
    agent: Literal["ready", "not-ready", "stale", "unseen"]
    active_version: str | None = None
    staged_versions: list[str] = Field(default_factory=list)
    self_check: str | None = None
    enforcer: str | None = None
    mode: str | None = None
    last_seen: datetime | None = None
    containers: int = 0
    granted_bytes: int = 0
    card_bytes: int | None = Field(None, description="per-GPU memory (node label nvidia.com/gpu.memory) times GPU count")
    overcommitted: bool = False
    problems: list[str] = Field(default_factory=list)


class NodeList(BaseModel):
    apiVersion: str = API_VERSION
    kind: Literal["IsolationNodeList"] = "IsolationNodeList"
    items: list[NodeRow]


# --- reading the objects ---------------------------------------------------------------------

def node_view(node: Obj) -> NodeAgentView | None:
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(NODE_VIEW_ANNOTATION)
    if not raw:
        return None
    try:
        return NodeAgentView.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None


def usage_by_container(nodes: list[Obj]) -> dict[tuple[str, str], ContainerUsageView]:
    """(pod uid, container) -> the node's latest usage row."""
    rows: dict[tuple[str, str], ContainerUsageView] = {}
    for node in nodes:
        view = node_view(node)
        for row in view.containers if view else ():
            rows[(row.uid, row.container)] = row
    return rows


def isolated_condition(pod: Obj) -> Obj | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == ISOLATED_CONDITION), None)


def target_container(pod: Obj) -> str:
    """The container the library targets, as the webhook picks it (init containers first, else containers[0])."""
    spec = pod.get("spec") or {}
    wanted = ((pod.get("metadata") or {}).get("annotations") or {}).get(FRACTION_CONTAINER_ANNOTATION)
    everything = list(spec.get("initContainers") or []) + list(spec.get("containers") or [])
    if wanted and any(c.get("name") == wanted for c in everything):
        return str(wanted)
    return str((spec.get("containers") or [{}])[0].get("name", ""))


def is_ours(event: Obj) -> bool:
    component = (event.get("source") or {}).get("component") or event.get("reportingComponent") or ""
    return event.get("reason") in EVENT_REASONS and component in OUR_COMPONENTS


def event_time(event: Obj) -> datetime | None:
    return (parse_time(event.get("lastTimestamp")) or parse_time(event.get("eventTime")) or parse_time(event.get("firstTimestamp"))
            or parse_time((event.get("metadata") or {}).get("creationTimestamp")))


def events_of(pod: Obj, events: list[Obj]) -> list[Obj]:
    meta = pod.get("metadata") or {}
    mine = [e for e in events if (e.get("involvedObject") or {}).get("kind") == "Pod"
            and (e.get("involvedObject") or {}).get("name") == meta.get("name")
            and (e.get("involvedObject") or {}).get("uid") in (None, "", meta.get("uid"))]
    return sorted(mine, key=lambda e: event_time(e) or datetime.min.replace(tzinfo=timezone.utc))


def limit_env(pod: Obj, container: str, configmaps: dict[tuple[str, str], Obj]) -> int | None:
    """The limit the pod's env claims for the container (a literal, or its ConfigMap key)."""
    spec = pod.get("spec") or {}
    ns = (pod.get("metadata") or {}).get("namespace", "")
    for c in list(spec.get("initContainers") or []) + list(spec.get("containers") or []):
        if c.get("name") != container:
            continue
        for env in c.get("env") or []:
            if env.get("name") != LIMIT_ENV:
                continue
            value = env.get("value")
            ref = ((env.get("valueFrom") or {}).get("configMapKeyRef") or {})
            if value is None and ref.get("name"):
                value = ((configmaps.get((ns, ref["name"])) or {}).get("data") or {}).get(ref.get("key") or LIMIT_ENV)
            try:
                return parse_limit(value) if value else None
            except ConfigError:
                return None
    return None


def tracked(pod: Obj) -> bool:
    """GPU-sharing by its annotations, or carrying our condition (its annotations may have been removed since)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return is_gpu_sharing(annotations) or isolated_condition(pod) is not None


def container_row(pod: Obj, events: list[Obj], usage: dict[tuple[str, str], ContainerUsageView],
                  configmaps: dict[tuple[str, str], Obj]) -> ContainerRow:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    condition = isolated_condition(pod)
    container = target_container(pod)
    if not is_gpu_sharing(annotations) and condition is not None:
        # A pod outside GPU sharing has no target: the container is the one our services judged.
        container = container_of_condition(str(condition.get("message") or "")) or container
    row = ContainerRow(namespace=meta.get("namespace", ""), pod=meta.get("name", ""), container=container, node=spec.get("nodeName"),
                       phase=status.get("phase"), verdict="pending",
                       requested=", ".join(f"{k}={annotations[k]}" for k in (GPU_MEMORY_ANNOTATION, GPU_FRACTION_ANNOTATION) if k in annotations))
    verdict = verdict_of_condition(str(condition.get("message") or "")) if condition else None
    if condition and verdict:
        row.verdict, row.reason, row.message, row.verdict_from = verdict, str(condition.get("reason") or ""), str(condition.get("message") or ""), "condition"
        row.verdict_at = parse_time(condition.get("lastProbeTime")) or parse_time(condition.get("lastTransitionTime"))
    else:
        ours = [e for e in events_of(pod, events) if is_ours(e)]
        if ours:
            last = ours[-1]
            row.verdict, row.verdict_from, row.verdict_at = EVENT_REASONS[last["reason"]], "event", event_time(last)  # type: ignore[assignment]
            row.message = str(last.get("message") or "")
            row.reason = _first_code(row.message) or row.verdict
    if row.phase in ("Succeeded", "Failed") and row.verdict == "pending":
        row.reason = row.phase.lower()
    elif row.verdict == "pending":
        row.reason = "not-running" if row.phase != "Running" else "awaiting-verdict"
    seen = usage.get((meta.get("uid", ""), container))
    if seen is not None:
        row.grant_bytes, row.grant_from = seen.grant_bytes, "node"
        row.used_bytes, row.usage_source = seen.used_bytes, seen.source
    else:
        claimed = limit_env(pod, container, configmaps)
        if claimed:
            row.grant_bytes, row.grant_from = claimed, "pod-env"
    return row


def _first_code(message: str) -> str:
    """`container main: missing (not-injected: ...)` (our Event wording) -> `not-injected`."""
    if "(" not in message:
        return ""
    return message.split("(", 1)[1].split(":", 1)[0].strip()


def sort_rows(rows: list[ContainerRow]) -> list[ContainerRow]:
    return sorted(rows, key=lambda r: (_ORDER[r.verdict], r.namespace, r.pod, r.container))


def has_problem(rows: list[ContainerRow]) -> bool:
    return any(r.verdict in PROBLEMS for r in rows)


# --- the story of one pod --------------------------------------------------------------------

def story(pod: Obj, events: list[Obj], usage: dict[tuple[str, str], ContainerUsageView], configmaps: dict[tuple[str, str], Obj]) -> PodStory:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    row = container_row(pod, events, usage, configmaps)
    entries: list[StoryEntry] = []
    requested = row.requested or "no gpu-memory / gpu-fraction annotation"
    entries.append(StoryEntry(time=parse_time(meta.get("creationTimestamp")), what="Created", detail=requested))
    injected = any(v.get("name") == VGPU_VOLUME for v in spec.get("volumes") or [])
    if not is_gpu_sharing(annotations):
        entries.append(StoryEntry(time=parse_time(meta.get("creationTimestamp")), what="OutsideGpuSharing",
                                  detail="the pod asks for no GPU share: on a GPU that KAI shares the node grants it nothing"))
    elif injected:
        entries.append(StoryEntry(time=parse_time(meta.get("creationTimestamp")), what="Injected",
                                  detail=f"libvgpu.so mounted read-only into container {row.container} by the admission webhook"))
    else:
        why = f" (annotation {INJECT_ANNOTATION}={annotations[INJECT_ANNOTATION]})" if INJECT_ANNOTATION in annotations else ""
        entries.append(StoryEntry(time=parse_time(meta.get("creationTimestamp")), what="NotInjected", kind="Warning",
                                  detail=f"the pod spec has no {VGPU_VOLUME} volume{why}"))
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    if spec.get("nodeName"):
        claimed = limit_env(pod, row.container, configmaps)
        limit = f", {LIMIT_ENV}={claimed >> 20}MiB" if claimed else f", no {LIMIT_ENV}"
        entries.append(StoryEntry(time=parse_time((conditions.get("PodScheduled") or {}).get("lastTransitionTime")), what="Bound",
                                  detail=f"to {spec['nodeName']}{limit}"))
    for state in status.get("containerStatuses") or []:
        started = ((state.get("state") or {}).get("running") or {}).get("startedAt")
        if state.get("name") == row.container and started:
            entries.append(StoryEntry(time=parse_time(started), what="Started", detail=f"container {row.container}"))
    for event in events_of(pod, events):
        if is_ours(event):
            entries.append(StoryEntry(time=event_time(event), what=str(event.get("reason")), detail=str(event.get("message") or ""),
                                      kind="Warning" if event.get("type") == "Warning" else "Normal",
                                      source=str((event.get("source") or {}).get("component") or "")))
    condition = conditions.get(ISOLATED_CONDITION)
    if condition:
        entries.append(StoryEntry(time=parse_time(condition.get("lastTransitionTime")), what=f"Condition {ISOLATED_CONDITION}={condition.get('status')}",
                                  detail=f"{condition.get('reason', '')}: {condition.get('message', '')}",
                                  kind="Normal" if condition.get("status") == "True" else "Warning"))
    entries.sort(key=lambda e: e.time or datetime.min.replace(tzinfo=timezone.utc))
    ours = {k: v for k, v in annotations.items() if k.startswith("kai-resource-isolator.io/") or k in (GPU_MEMORY_ANNOTATION, GPU_FRACTION_ANNOTATION, FRACTION_CONTAINER_ANNOTATION)}
    return PodStory(namespace=meta.get("namespace", ""), pod=meta.get("name", ""), uid=meta.get("uid", ""), node=spec.get("nodeName"),
                    containers=[row], story=entries, annotations=ours)


# --- nodes ------------------------------------------------------------------------------------

def is_gpu_node(node: Obj) -> bool:
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    capacity = (status.get("capacity") or {}).get("nvidia.com/gpu")
    return (NODE_VIEW_ANNOTATION in (meta.get("annotations") or {}) or GPU_MEMORY_NODE_LABEL in (meta.get("labels") or {})
            or (capacity not in (None, "0")))


def node_row(node: Obj, now: datetime) -> NodeRow:
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    view = node_view(node)
    count = _int((node.get("status") or {}).get("capacity", {}).get("nvidia.com/gpu")) or _int(labels.get("nvidia.com/gpu.count")) or 1
    per_gpu = _int(labels.get(GPU_MEMORY_NODE_LABEL))
    card = (per_gpu << 20) * count if per_gpu else None
    row = NodeRow(node=meta.get("name", ""), agent="unseen", card_bytes=card)
    if view is None:
        return row
    age = (now - view.last_seen).total_seconds()
    row.agent = "stale" if age > STALE_AGENT_S else "ready" if view.ready else "not-ready"
    row.active_version, row.staged_versions = view.active_version, view.staged_versions
    row.self_check, row.enforcer, row.last_seen, row.problems = view.self_check, view.enforcer, view.last_seen, view.problems
    row.mode = view.mode
    row.containers = len(view.containers)
    row.granted_bytes = sum(c.grant_bytes or 0 for c in view.containers)
    row.overcommitted = card is not None and row.granted_bytes > card
    return row


def node_problem(row: NodeRow) -> bool:
    return row.agent in ("stale", "not-ready") or row.self_check == "failed"


def _int(value: object) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def to_jsonable(model: BaseModel) -> Any:
    return json.loads(model.model_dump_json())
