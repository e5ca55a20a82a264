"""Pure pod -> JSON patch logic: which pods and which container get libvgpu.so, and the RFC 6902
operations that bring the pod to the injected shape (only what is missing or wrong)."""

from __future__ import annotations

import operator
import posixpath
from dataclasses import dataclass, field as dataclass_field
from typing import Any

from kai_isolator.shared.contract import (
    DEFAULT_GRANT_DIR, DEFAULT_STATE_DIR, DEFAULT_VGPU_MOUNT, FRACTION_CONTAINER_ANNOTATION as CONTAINER_NAME_ANNOTATION,
    GPU_FRACTION_ANNOTATION, GPU_MEMORY_ANNOTATION, GRANT_MOUNT_PATH, GRANT_VOLUME, INJECT_ANNOTATION, PRELOAD_PATH,
    PRELOAD_SUBPATH, STATE_MOUNT_PATH, STATE_VOLUME, USAGE_CACHE_PATH, VGPU_VOLUME,
)
from kai_isolator.shared.errors import IsolatorError
from kai_isolator.shared.operator_view import ISOLATED_CONDITION

Json = dict[str, Any]
Op = dict[str, Any]


class PodUnreadable(IsolatorError):
    """`request.object` claims to be a Pod but lacks the shape we must read."""


class NoTargetContainer(IsolatorError):
    """The fraction container cannot be resolved (no containers, or the named one is absent)."""


@dataclass(frozen=True)
class InjectionConfig:
    container_vgpu_mount: str = DEFAULT_VGPU_MOUNT
    state_dir: str = DEFAULT_STATE_DIR
    allow_pod_opt_out: bool = True
    grant_dir: str = DEFAULT_GRANT_DIR


@dataclass(frozen=True)
class Target:
    """The fraction container: which list it is in, its index there, and the container itself."""

    field: str
    index: int
    container: Json
    env_names: list[str] = dataclass_field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.container["name"])

    @property
    def is_init(self) -> bool:
        return self.field == "initContainers"

    @property
    def pointer(self) -> str:
        return f"/spec/{self.field}/{self.index}"


@dataclass(frozen=True)
class Desired:
    """What the injected pod carries for one target: volumes, the target's mounts and env."""

    volumes: tuple[Json, ...]
    mounts: tuple[Json, ...]
    env: tuple[Json, ...]

    def volume(self, name: str) -> Json | None:
        return next((v for v in self.volumes if v["name"] == name), None)

    def env_by_name(self) -> dict[str, Json]:
        return {e["name"]: e for e in self.env}


# --- reading the pod -------------------------------------------------------------------


def clean_path(value: Any, where: str) -> str:
    """A mount path as the runtime will resolve it ('/etc/./ld.so.preload' is '/etc/ld.so.preload')."""
    if not isinstance(value, str) or not value:
        raise PodUnreadable(f"{where}.mountPath must be a non-empty string")
    cleaned = posixpath.normpath("/" + value)
    return "/" + cleaned.lstrip("/")


def is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def annotations_of(pod: Any) -> dict[str, str]:
    if not isinstance(pod, dict):
        raise PodUnreadable("request.object is not a JSON object")
    metadata = pod.get("metadata")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise PodUnreadable("metadata is not an object")
    annotations = metadata.get("annotations")
    if annotations is None:
        return {}
    if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
        raise PodUnreadable("metadata.annotations must map strings to strings")
    return annotations


def is_gpu_sharing(annotations: dict[str, str]) -> bool:
    return GPU_FRACTION_ANNOTATION in annotations or GPU_MEMORY_ANNOTATION in annotations


def asks_opt_out(annotations: dict[str, str]) -> bool:
    return annotations.get(INJECT_ANNOTATION, "").lower() == "false"


def _list_of_objects(value: Any, where: str) -> list[Json]:
    if value is None:
        return []
    if type(value) is not list or not set(map(type, value)) <= {dict}:
        raise PodUnreadable(f"{where} must be a list of objects")
    return value


def _check_container(container: Json, where: str) -> None:
    """What we read from every container: its name, its mounts and its security context."""
    if not isinstance(container.get("name"), str) or not container["name"]:
        raise PodUnreadable(f"{where}.name must be a non-empty string")
    for j, mount in enumerate(_list_of_objects(container.get("volumeMounts"), f"{where}.volumeMounts")):
        clean_path(mount.get("mountPath"), f"{where}.volumeMounts[{j}]")
        if not isinstance(mount.get("name"), str):
            raise PodUnreadable(f"{where}.volumeMounts[{j}].name must be a string")
    if container.get("securityContext") is not None and not isinstance(container["securityContext"], dict):
        raise PodUnreadable(f"{where}.securityContext must be an object")


_NAME = operator.itemgetter("name")


def env_names(container: Json, where: str) -> list[str]:
    """The names of a container's env entries, checked (only the target's env is read)."""
    env = _list_of_objects(container.get("env"), f"{where}.env")
    try:
        names = list(map(_NAME, env))  # C-level: env lists run to hundreds of entries
    except KeyError:
        names = [e.get("name") for e in env]
    if not set(map(type, names)) <= {str}:
        raise PodUnreadable(f"{where}.env[{next(i for i, n in enumerate(names) if type(n) is not str)}].name must be a string")
    return names


@dataclass(frozen=True)
class PodView:
    """A Pod checked once for every field the webhook reads."""

    pod: Json
    annotations: dict[str, str]
    spec: Json
    init_containers: list[Json]
    containers: list[Json]
    volumes: list[Json] | None

    def all_containers(self) -> list[tuple[str, int, Json]]:
        return [("initContainers", i, c) for i, c in enumerate(self.init_containers)] + [("containers", i, c) for i, c in enumerate(self.containers)]


def read_pod(pod: Any, annotations: dict[str, str] | None = None) -> PodView:
    if annotations is None:
        annotations = annotations_of(pod)
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise PodUnreadable("spec is missing or not an object")
    lists = {}
    for field in ("initContainers", "containers"):
        lists[field] = _list_of_objects(spec.get(field), f"spec.{field}")
        for i, container in enumerate(lists[field]):
            _check_container(container, f"spec.{field}[{i}]")
    volumes = spec.get("volumes")
    for i, volume in enumerate(_list_of_objects(volumes, "spec.volumes")):
        if not isinstance(volume.get("name"), str):
            raise PodUnreadable(f"spec.volumes[{i}].name must be a string")
    return PodView(pod, annotations, spec, lists["initContainers"], lists["containers"], volumes)


def find_target(view: PodView) -> Target:
    """The fraction container, resolved as KAI-Scheduler does: a named one (init containers
    first), else containers[0]."""
    field, index, container = _resolve_target(view)
    return Target(field, index, container, env_names(container, f"spec.{field}[{index}]"))


def _resolve_target(view: PodView) -> tuple[str, int, Json]:
    if CONTAINER_NAME_ANNOTATION in view.annotations:
        wanted = view.annotations[CONTAINER_NAME_ANNOTATION]
        for field, index, container in view.all_containers():
            if container["name"] == wanted:
                return field, index, container
        raise NoTargetContainer(f"container with name {wanted!r} not found for fraction request ({CONTAINER_NAME_ANNOTATION})")
    if not view.containers:
        raise NoTargetContainer("pod has no containers")
    return "containers", 0, view.containers[0]


# --- the injected shape ----------------------------------------------------------------


def desired_for(target: Target, config: InjectionConfig) -> Desired:
    lib = config.container_vgpu_mount
    volumes: list[Json] = [{"name": VGPU_VOLUME, "hostPath": {"path": lib, "type": "Directory"}}]
    mounts: list[Json] = [
        {"name": VGPU_VOLUME, "mountPath": lib, "readOnly": True},
        {"name": VGPU_VOLUME, "mountPath": PRELOAD_PATH, "subPath": PRELOAD_SUBPATH, "readOnly": True},
    ]
    if target.is_init:
        return Desired(tuple(volumes), tuple(mounts), ())
    per_container = f"$(POD_UID)_{target.name}"
    volumes.append({"name": STATE_VOLUME, "hostPath": {"path": config.state_dir, "type": "DirectoryOrCreate"}})
    # The node agent's grant (root-owned, read-only here): the limits the library obeys whatever the env says.
    volumes.append({"name": GRANT_VOLUME, "hostPath": {"path": config.grant_dir, "type": "DirectoryOrCreate"}})
    mounts.append({"name": STATE_VOLUME, "mountPath": STATE_MOUNT_PATH, "subPathExpr": per_container})
    mounts.append({"name": GRANT_VOLUME, "mountPath": GRANT_MOUNT_PATH, "subPathExpr": per_container, "readOnly": True})
    env = (
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}},
        {"name": "CONTAINER_NAME", "value": target.name},
        {"name": "CONTAINER_VGPU_MOUNT", "value": lib},
        {"name": "CUDA_DEVICE_MEMORY_SHARED_CACHE", "value": USAGE_CACHE_PATH},
    )
    return Desired(tuple(volumes), tuple(mounts), env)


def canonical(value: Any) -> Any:
    """Drop fields at their zero value, so `readOnly: false` or `subPath: ""` equals absent."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items() if v not in (None, "", False, [], {})}
    return value


def same(existing: Json, wanted: Json) -> bool:
    return canonical(existing) == canonical(wanted)


# --- the patch -------------------------------------------------------------------------


def _sync_list(path: str, current: list[Json] | None, wanted: tuple[Json, ...], key: Any, keys: list[Any] | None = None) -> list[Op]:
    """Ops that make every wanted item present exactly as wanted, matching items by `key`.

    A missing list is created whole; a missing item is appended; an item with the same key
    but other content is replaced in place (a duplicate key would be rejected by the API).
    """
    if not wanted:
        return []
    if current is None:
        return [{"op": "add", "path": path, "value": [dict(w) for w in wanted]}]
    matches: dict[Any, list[int]] = {key(w): [] for w in wanted}
    if keys is None:
        keys = [key(item) for item in current]
    for k in matches.keys() & set(keys):
        matches[k] = [i for i, existing in enumerate(keys) if existing == k]
    ops: list[Op] = []
    for item in wanted:
        indices = matches[key(item)]
        if not indices:
            ops.append({"op": "add", "path": f"{path}/-", "value": dict(item)})
        ops.extend({"op": "replace", "path": f"{path}/{i}", "value": dict(item)} for i in indices if not same(current[i], item))
    return ops


def _mount_key(mount: Json) -> str:
    return clean_path(mount.get("mountPath"), "volumeMount")


def _name_key(item: Json) -> Any:
    return item.get("name")


def patch_ops(view: PodView, target: Target, config: InjectionConfig, desired: Desired | None = None) -> list[Op]:
    """Volumes, then the target's mounts, then its env (upstream's order), then read-only
    fixes for other mounts of our volumes. Empty when the pod is already injected."""
    desired = desired or desired_for(target, config)
    ops = _sync_list("/spec/volumes", view.volumes, desired.volumes, _name_key)
    ops += _sync_list(f"{target.pointer}/volumeMounts", target.container.get("volumeMounts"), desired.mounts, _mount_key)
    ops += _sync_list(f"{target.pointer}/env", target.container.get("env"), desired.env, _name_key, target.env_names)
    ops += _read_only_fixes(view, target, desired)
    return ops


def _read_only_fixes(view: PodView, target: Target, desired: Desired) -> list[Op]:
    """Any other mount of a volume we define becomes read-only: the library dir is the node's,
    and the state dir holds every container's accounting. The grant's name is ours even where
    this target gets no grant (an init container): nobody may write under that name."""
    guarded = {v["name"] for v in desired.volumes} | {GRANT_VOLUME}
    own_paths = {m["mountPath"] for m in desired.mounts}
    ops: list[Op] = []
    for field, index, container in view.all_containers():
        is_target = field == target.field and index == target.index
        for j, mount in enumerate(container.get("volumeMounts") or ()):
            if mount.get("name") not in guarded or mount.get("readOnly") is True:
                continue
            if is_target and _mount_key(mount) in own_paths:
                continue  # replaced by the target's own mount above
            ops.append({"op": "add", "path": f"/spec/{field}/{index}/volumeMounts/{j}/readOnly", "value": True})
    return ops


def readiness_gate_ops(view: PodView) -> list[Op]:
    """The op that makes the pod wait for the verifier's Isolated condition before it is Ready
    (readinessGates are fixed at creation, which is when the webhook sees the pod)."""
    gates = _list_of_objects(view.spec.get("readinessGates"), "spec.readinessGates")
    gate = {"conditionType": ISOLATED_CONDITION}
    if any(g.get("conditionType") == ISOLATED_CONDITION for g in gates):
        return []
    if "readinessGates" not in view.spec:
        return [{"op": "add", "path": "/spec/readinessGates", "value": [gate]}]
    return [{"op": "add", "path": "/spec/readinessGates/-", "value": gate}]
