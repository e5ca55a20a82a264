"""Computing one container's grant from what KAI left on the pod (its ConfigMap's limit and devices, the pod's
annotation, the node's card size, the GPUs KAI's reservation pods hold): the smaller of the two limits, on the
devices KAI reserved, never raised once written, and the reasons when inputs disagree or are missing. Pure: no API,
no files."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kai_isolator.shared.contract import (
    FRACTION_CONTAINER_ANNOTATION, GPU_GROUP_LABEL, KAI_CONFIGMAP_ANNOTATION, LIMIT_ENV, NUM_DEVICES_ANNOTATION, RESERVED_GPU_ANNOTATION,
    gpu_groups,
)
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.events import Reason
from kai_isolator.shared.grant import GPU_MEMORY_NODE_LABEL, DeviceGrant, Grant, GrantSource, annotation_limit_bytes
from kai_isolator.shared.limits import parse_limit

Obj = dict[str, Any]
DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
CDI_GPU_PREFIX = "k8s.device-plugin.nvidia.com/gpu="
_DEVICE_ID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9/-]+$")


@dataclass(frozen=True)
class EnvRef:
    """Where an env var of the target gets its value: a literal, or a key of a ConfigMap."""

    literal: str | None = None
    configmap: str | None = None
    key: str = ""


@dataclass(frozen=True)
class Inputs:
    """What one computation read: the env values as the container will see them, the node's card size, and the GPU
    each of KAI's reservation pods on the node holds (GPU group -> the UUIDs its reservation pods wrote)."""

    limit: str | None
    devices: str | None
    node_label: str | None
    missing_configmaps: tuple[str, ...] = ()
    reserved: Mapping[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """The grant to write (or none), with the reasons a reader needs when the inputs disagreed or were missing."""

    container: str
    grant: Grant | None
    reasons: tuple[Reason, ...] = ()
    configmap_limit_bytes: int | None = None
    annotation_limit_bytes: int | None = None
    retry: bool = False  # an input may still appear (a ConfigMap not written yet)


def target_container(pod: Obj) -> Obj | None:
    """The fraction container as KAI resolves it: the named one (init containers first), else containers[0]."""
    spec = pod.get("spec") or {}
    wanted = ((pod.get("metadata") or {}).get("annotations") or {}).get(FRACTION_CONTAINER_ANNOTATION)
    if wanted:
        for key in ("initContainers", "containers"):
            for container in spec.get(key) or []:
                if isinstance(container, dict) and container.get("name") == wanted:
                    return container
        return None
    containers = spec.get("containers") or []
    return containers[0] if containers and isinstance(containers[0], dict) else None


def env_ref(container: Obj, name: str) -> EnvRef | None:
    """The last definition of `name` in the container's env wins, as in kubelet."""
    found = None
    for item in container.get("env") or []:
        if not isinstance(item, dict) or item.get("name") != name:
            continue
        if item.get("value") is not None:
            found = EnvRef(literal=str(item["value"]))
            continue
        ref = (item.get("valueFrom") or {}).get("configMapKeyRef") or {}
        found = EnvRef(configmap=str(ref["name"]), key=str(ref.get("key") or name)) if ref.get("name") else None
    return found


def reservation(pod: Obj, node: str) -> tuple[str, str] | None:
    """(GPU group, GPU UUID) that a reservation pod of KAI's on `node` holds, once its program has written the UUID."""
    meta = pod.get("metadata") or {}
    group = (meta.get("labels") or {}).get(GPU_GROUP_LABEL)
    device = (meta.get("annotations") or {}).get(RESERVED_GPU_ANNOTATION)
    if not group or not device or (pod.get("spec") or {}).get("nodeName") != node or meta.get("deletionTimestamp"):
        return None
    return str(group), str(device)


def held_by_group(reservations: Iterable[tuple[str, str]]) -> dict[str, frozenset[str]]:
    """GPU group -> the GPUs reserved for it (one, unless KAI is mid-change)."""
    held: dict[str, set[str]] = {}
    for group, device in reservations:
        held.setdefault(group, set()).add(device)
    return {group: frozenset(devices) for group, devices in held.items()}


def parse_devices(value: str) -> tuple[str, ...]:
    """GPU UUIDs from NVIDIA_VISIBLE_DEVICES as KAI writes it: comma-separated, possibly in CDI form."""
    ids = [token.strip().removeprefix(CDI_GPU_PREFIX) for token in value.split(",") if token.strip()]
    if not ids:
        raise ConfigError(f"{DEVICES_ENV} names no device: {value!r}")
    bad = [i for i in ids if not _DEVICE_ID.match(i)]
    if bad:
        raise ConfigError(f"{DEVICES_ENV} entries are not GPU UUIDs: {', '.join(map(repr, bad))}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{DEVICES_ENV} names a device twice: {value!r}")
    return tuple(ids)


def decide(pod: Obj, container: Obj, inputs: Inputs) -> Decision:
    """The grant for `container` of `pod`: min(ConfigMap limit, annotation recomputation) on each listed device."""
    meta = pod.get("metadata") or {}
    name = str(container.get("name") or "")
    reasons: list[Reason] = []
    if inputs.missing_configmaps:
        which = ", ".join(inputs.missing_configmaps)
        return Decision(name, None, (Reason(code="configmap-missing", message=f"ConfigMap {which} not found (yet)"),), retry=True)
    configmap_limit = annotation_limit = None
    devices: tuple[str, ...] = ()
    retry = False
    if inputs.limit is None and inputs.devices is None and KAI_CONFIGMAP_ANNOTATION not in (meta.get("annotations") or {}):
        return Decision(name, None, (_not_admitted_by_kai(pod, name),))
    if inputs.limit is None:
        reasons.append(Reason(code="limit-missing", message=_why_no_limit(container, name)))
    else:
        try:
            configmap_limit = parse_limit(inputs.limit)
            if configmap_limit <= 0:
                raise ConfigError(f"{LIMIT_ENV}={inputs.limit!r} is no limit")
        except ConfigError as error:
            configmap_limit = None
            reasons.append(Reason(code="limit-invalid", message=str(error)))
    if inputs.devices is None:
        reasons.append(Reason(code="devices-missing", message=f"{DEVICES_ENV} is not set for container {name}"))
    else:
        try:
            devices = parse_devices(inputs.devices)
            _as_many_as_asked(devices, meta.get("annotations") or {})
        except ConfigError as error:
            devices = ()
            reasons.append(Reason(code="devices-invalid", message=str(error)))
        else:
            unreserved = _reserved_by_kai(devices, meta.get("labels") or {}, inputs.reserved)
            if unreserved is not None:
                devices = ()
                reasons.append(unreserved)
                retry = unreserved.code == "devices-unreserved"  # KAI's reservation may not have been seen yet
    try:
        label = int(inputs.node_label or "")
    except ValueError:
        reasons.append(Reason(code="node-label-invalid", message=f"node label {GPU_MEMORY_NODE_LABEL}={inputs.node_label!r} is not a MiB count"))
    else:
        try:
            annotation_limit = annotation_limit_bytes(meta.get("annotations") or {}, label)
        except ConfigError as error:
            reasons.append(Reason(code="annotation-invalid", message=str(error)))
    if configmap_limit is None or annotation_limit is None or not devices:
        return Decision(name, None, tuple(reasons), configmap_limit, annotation_limit, retry=retry)
    source = GrantSource.CONFIGMAP if configmap_limit <= annotation_limit else GrantSource.ANNOTATION
    limit = min(configmap_limit, annotation_limit)
    why = ""
    if configmap_limit != annotation_limit:
        why = (f"ConfigMap {LIMIT_ENV} ({configmap_limit} bytes) disagrees with the {_request(meta)} recomputed on a "
               f"{inputs.node_label} MiB card ({annotation_limit} bytes); the smaller is granted")
        reasons.append(Reason(code="limit-disagrees", message=why))
    grant = Grant(
        pod_uid=str(meta.get("uid") or ""), namespace=str(meta.get("namespace") or ""), pod=str(meta.get("name") or ""),
        container=name, devices=tuple(DeviceGrant(uuid=d, limit_bytes=limit) for d in devices), source=source,
        configmap_limit_bytes=configmap_limit, annotation_limit_bytes=annotation_limit, reason=why,
    )
    return Decision(name, grant, tuple(reasons), configmap_limit, annotation_limit)


def _as_many_as_asked(devices: tuple[str, ...], annotations: dict[str, str]) -> None:
    """KAI gives a pod one GPU per device it asked for; a ConfigMap naming more would grant the limit on each (the
    ConfigMap is the tenant's to edit, the annotation is fixed once the pod exists)."""
    asked = annotations.get(NUM_DEVICES_ANNOTATION) or "1"
    if not asked.isdigit() or int(asked) < 1:
        raise ConfigError(f"annotation {NUM_DEVICES_ANNOTATION}={asked!r} is not a device count")
    if len(devices) != int(asked):
        raise ConfigError(f"{DEVICES_ENV} names {len(devices)} device(s), but the pod asked KAI for {asked} ({NUM_DEVICES_ANNOTATION})")


def _reserved_by_kai(devices: tuple[str, ...], labels: Mapping[str, str], reserved: Mapping[str, frozenset[str]]) -> Reason | None:
    """Each device is the GPU KAI reserved for one of the pod's GPU groups on this node. The ConfigMap that names the
    devices is the tenant's to edit; the reservation pods live in KAI's namespace, where the tenant writes nothing."""
    groups = gpu_groups(dict(labels))
    if not groups:
        return Reason(code="devices-unreserved", message=f"the pod has no {GPU_GROUP_LABEL} label: KAI's binder has not given it a GPU (yet)")
    missing = sorted(g for g in groups if len(reserved.get(g, ())) != 1)
    if missing:
        return Reason(code="devices-unreserved", message=(
            f"no single GPU is reserved by KAI on this node for GPU group {', '.join(missing)} (no reservation pod, or it has not "
            "written its GPU's UUID yet)"))
    held = sorted(device for g in groups for device in reserved[g])
    if held != sorted(devices):
        return Reason(code="devices-not-reserved", message=(
            f"{DEVICES_ENV} names {', '.join(devices)}, but KAI reserved {', '.join(held)} for the pod's GPU group(s) on this node"))
    return None


def _not_admitted_by_kai(pod: Obj, name: str) -> Reason:
    """A GPU-sharing annotation that KAI-Scheduler never acted on: KAI admits only pods naming its scheduler, and always
    names their ConfigMaps (`runai/shared-gpu-configmap`). No GPU share was allocated, so there is nothing to grant."""
    scheduler = (pod.get("spec") or {}).get("schedulerName") or "default-scheduler"
    return Reason(code="not-admitted-by-kai", message=(
        f"the pod asks for a GPU share ({_request(pod.get('metadata') or {})}) but KAI-Scheduler did not admit it "
        f"(schedulerName {scheduler!r}, no {KAI_CONFIGMAP_ANNOTATION} annotation): no GPU share was allocated to container "
        f"{name}, so it gets no grant and every GPU allocation in it fails; set schedulerName: kai-scheduler"))


def _why_no_limit(container: Obj, name: str) -> str:
    if env_ref(container, LIMIT_ENV) is None:
        return (f"{LIMIT_ENV} is not set for container {name}: KAI's admission gave it none, as KAI does with its hamicore "
                "plugin off (binder.plugins.hamicore.enabled=false), so there is no limit to grant")
    return (f"{LIMIT_ENV} is not set for container {name}: KAI's binder wrote none into its ConfigMap, as it does when the "
            f"node's {GPU_MEMORY_NODE_LABEL} label is missing or not a MiB count")


def _request(meta: Obj) -> str:
    annotations = meta.get("annotations") or {}
    for key in ("gpu-memory", "gpu-fraction"):
        if key in annotations:
            return f"{key} annotation {annotations[key]!r}"
    return "annotation"


def never_raised(new: Grant, old: Grant | None) -> tuple[Grant, Reason | None]:
    """A grant once written only ever shrinks: the tenant may edit its ConfigMap and its pod's annotations later."""
    if old is None or old.pod_uid != new.pod_uid:
        return new, None
    old_limits = {d.uuid: d.limit_bytes for d in old.devices}
    if set(old_limits) != {d.uuid for d in new.devices}:
        return old, Reason(code="grant-kept", message=f"the devices changed from {sorted(old_limits)} after the grant was written; it stays")
    if any(d.limit_bytes > old_limits[d.uuid] for d in new.devices):
        return old, Reason(code="grant-kept", message="a later computation would raise the written grant; it stays")
    return new, None
