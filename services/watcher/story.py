"""A GPU-sharing pod's isolation story: what a pod object says, and which events a change to it means.

Pure functions over the raw pod JSON and the stored record of what was already published,
so replays, relists and restarts reach the same answer.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kai_isolator.shared.contract import (
    FRACTION_CONTAINER_ANNOTATION as FRACTION_CONTAINER,
    GPU_FRACTION_ANNOTATION as GPU_FRACTION,
    GPU_MEMORY_ANNOTATION as GPU_MEMORY,
    INJECT_ANNOTATION, LIMIT_ENV, PRELOAD_PATH, PRELOAD_SUBPATH, VGPU_VOLUME,
)
from kai_isolator.shared.events import PodIsolation, PodRef, PodState, Reason

FINISHED_PHASES = ("Succeeded", "Failed")
STATE_ORDER: tuple[PodState, ...] = ("admitted", "isolation-missing", "scheduled", "running", "finished")

Pod = dict[str, Any]


class PodRecord(BaseModel):
    """What the watcher last published for one pod; kept in KV so a restart repeats nothing."""

    model_config = ConfigDict(extra="ignore")
    uid: str
    namespace: str
    name: str
    resource_version: str
    emitted: list[PodState] = Field(default_factory=list)
    node_name: str | None = None
    phase: str | None = None
    container: str | None = None
    injected: bool = False
    gpu_fraction: str | None = None
    gpu_memory: str | None = None
    expected_limit: str | None = None
    pending: list[PodIsolation] = Field(default_factory=list, description="events of the last change, written before they are published")


@dataclass(frozen=True)
class LimitSource:
    """Where the pod reads CUDA_DEVICE_MEMORY_LIMIT: a literal, or a key of a ConfigMap KAI's binder fills."""

    literal: str | None = None
    configmap: str | None = None
    key: str = LIMIT_ENV


@dataclass(frozen=True)
class PodView:
    """The facts about one GPU-sharing pod the isolation story depends on."""

    uid: str
    namespace: str
    name: str
    resource_version: str
    node_name: str | None
    phase: str | None
    container: str | None
    injected: bool
    opted_out: bool
    gpu_fraction: str | None
    gpu_memory: str | None
    limit: LimitSource | None


def _target(spec: Pod, annotations: dict[str, str]) -> Pod | None:
    wanted = annotations.get(FRACTION_CONTAINER)
    if wanted:
        for key in ("initContainers", "containers"):
            for container in spec.get(key) or []:
                if isinstance(container, dict) and container.get("name") == wanted:
                    return container
        return None
    containers = spec.get("containers") or []
    return containers[0] if containers and isinstance(containers[0], dict) else None


def _is_injected(spec: Pod, container: Pod | None) -> bool:
    """The webhook's shape, not just its names: a tenant's own volume called like ours is no injection."""
    if container is None:
        return False
    library = next((v for v in spec.get("volumes") or [] if isinstance(v, dict) and v.get("name") == VGPU_VOLUME), None)
    host_path = (library or {}).get("hostPath")
    if not isinstance(host_path, dict) or host_path.get("type") != "Directory":
        return False
    return any(
        isinstance(m, dict) and m.get("name") == VGPU_VOLUME and m.get("readOnly") is True and m.get("subPath") == PRELOAD_SUBPATH
        and posixpath.normpath(str(m.get("mountPath", ""))) == PRELOAD_PATH
        for m in container.get("volumeMounts") or []
    )


def _limit_source(container: Pod | None) -> LimitSource | None:
    for env in (container or {}).get("env") or []:
        if not isinstance(env, dict) or env.get("name") != LIMIT_ENV:
            continue
        if env.get("value") is not None:
            return LimitSource(literal=str(env["value"]))
        ref = (env.get("valueFrom") or {}).get("configMapKeyRef") or {}
        if ref.get("name"):
            return LimitSource(configmap=str(ref["name"]), key=str(ref.get("key") or LIMIT_ENV))
    return None


def view_of(pod: Pod) -> PodView | None:
    """The pod's isolation facts, or None when it does not share a GPU (nothing to tell)."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict) or (GPU_FRACTION not in annotations and GPU_MEMORY not in annotations):
        return None
    spec = pod.get("spec") or {}
    container = _target(spec, annotations)
    return PodView(
        uid=str(meta.get("uid", "")), namespace=str(meta.get("namespace", "")), name=str(meta.get("name", "")),
        resource_version=str(meta.get("resourceVersion", "")), node_name=spec.get("nodeName") or None,
        phase=(pod.get("status") or {}).get("phase"), container=container.get("name") if container else None,
        injected=_is_injected(spec, container), opted_out=str(annotations.get(INJECT_ANNOTATION, "")).lower() == "false",
        gpu_fraction=annotations.get(GPU_FRACTION), gpu_memory=annotations.get(GPU_MEMORY), limit=_limit_source(container),
    )


def due_states(view: PodView) -> list[PodState]:
    """Every state this observation of the pod justifies, in story order."""
    states: list[PodState] = ["admitted"]
    if not view.injected:
        states.append("isolation-missing")
    if view.node_name:
        states.append("scheduled")
    if view.phase == "Running":
        states.append("running")
    if view.phase in FINISHED_PHASES:
        states.append("finished")
    return states


def needs_limit(view: PodView, record: PodRecord | None) -> bool:
    """Whether resolving the expected limit is worth an API read: a new scheduled/running event is due."""
    emitted = set(record.emitted) if record else set()
    return any(s in ("scheduled", "running") and s not in emitted for s in due_states(view))


def missing_reasons(view: PodView) -> list[Reason]:
    if view.opted_out:
        return [Reason(code="opted-out", message=f"the pod asks not to be isolated ({INJECT_ANNOTATION}: \"false\")")]
    if view.container is None:
        return [Reason(code="no-target-container", message=f"no container named by {FRACTION_CONTAINER}")]
    return [Reason(code="not-injected", message="GPU-sharing pod carries no vGPU library mount: the webhook was down, failed open, or skipped it")]


def advance(view: PodView, record: PodRecord | None, expected_limit: str | None) -> tuple[list[PodIsolation], PodRecord]:
    """The events not yet published for this observation, and the record after publishing them."""
    if record is not None and record.uid != view.uid:
        record = None  # a new pod took the name; its story starts over
    emitted = list(record.emitted) if record else []
    limit = expected_limit or (record.expected_limit if record else None)
    events = []
    for state in due_states(view):
        if state in emitted:
            continue
        emitted.append(state)
        events.append(_event(view, state, limit))
    updated = PodRecord(
        uid=view.uid, namespace=view.namespace, name=view.name, resource_version=view.resource_version, emitted=emitted,
        node_name=view.node_name, phase=view.phase, container=view.container, injected=view.injected,
        gpu_fraction=view.gpu_fraction, gpu_memory=view.gpu_memory, expected_limit=limit, pending=events,
    )
    return events, updated


def _event(view: PodView, state: PodState, limit: str | None) -> PodIsolation:
    return PodIsolation(
        pod=PodRef(namespace=view.namespace, name=view.name, uid=view.uid), resource_version=view.resource_version, state=state,
        phase=view.phase, node_name=view.node_name, container=view.container, injected=view.injected,
        gpu_fraction=view.gpu_fraction, gpu_memory=view.gpu_memory, expected_limit=limit,
        reasons=missing_reasons(view) if state == "isolation-missing" else [],
    )


def deletion(record: PodRecord, resource_version: str) -> PodIsolation:
    """The `deleted` event closing a pod's story."""
    return PodIsolation(
        pod=PodRef(namespace=record.namespace, name=record.name, uid=record.uid), resource_version=resource_version, state="deleted",
        phase=record.phase, node_name=record.node_name, container=record.container, injected=record.injected,
        gpu_fraction=record.gpu_fraction, gpu_memory=record.gpu_memory, expected_limit=record.expected_limit,
    )
