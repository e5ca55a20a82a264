"""Pure pod -> JSON patch logic: which pods and which container get libvgpu.so, and the RFC 6902
operations that bring the pod to the injected shape (only what is missing or wrong)."""

from __future__ import annotations

import functools
import operator
import posixpath
from dataclasses import dataclass
from typing import Any

import orjson

from kai_isolator.shared.contract import (
    CONTAINER_NAME_ENV, CONTAINER_VGPU_MOUNT_ENV, DEFAULT_GRANT_DIR, DEFAULT_STATE_DIR, DEFAULT_VGPU_MOUNT,
    FRACTION_CONTAINER_ANNOTATION as CONTAINER_NAME_ANNOTATION, GPU_FRACTION_ANNOTATION, GPU_MEMORY_ANNOTATION,
    GRANT_MOUNT_PATH, GRANT_VOLUME, INJECT_ANNOTATION, LIMIT_ENV, POD_UID_ENV, PRELOAD_PATH, PRELOAD_SUBPATH,
    SHARED_CACHE_ENV, STATE_MOUNT_PATH, STATE_VOLUME, USAGE_CACHE_PATH, VGPU_VOLUME,
)
from kai_isolator.shared.errors import IsolatorError
from kai_isolator.shared.operator_view import ISOLATED_CONDITION

Json = dict[str, Any]
Op = dict[str, Any]

# Env that turns the library off or loads code ahead of it.
ESCAPE_ENV = frozenset({"CUDA_DISABLE_CONTROL", "LD_PRELOAD", "LD_AUDIT"})
# Env that would move the library's limits, devices or accounting if it read them (the grant is what counts).
GRANT_ENV = frozenset({"CUDA_VISIBLE_DEVICES", SHARED_CACHE_ENV})
PER_DEVICE_LIMIT_PREFIX = f"{LIMIT_ENV}_"
MANAGED_ENV = frozenset({POD_UID_ENV, CONTAINER_NAME_ENV, CONTAINER_VGPU_MOUNT_ENV, SHARED_CACHE_ENV})
# Every env name the patch or the policy reads in the target; the rest of a long env list is never looked at again.
ENV_OF_INTEREST = ESCAPE_ENV | GRANT_ENV | MANAGED_ENV
# Volume names the webhook defines (or reserves): the only mounts the patch and the policy look at twice.
OUR_VOLUMES = frozenset({VGPU_VOLUME, STATE_VOLUME, GRANT_VOLUME})
_DESIRED_PER_CONFIG = 4096


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


class Target:
    """The fraction container: which list it is in, its index there, the container itself, and its
    env read once: the names, and the positions of the entries any decision looks at."""

    __slots__ = ("field", "index", "container", "name", "is_init", "pointer", "env", "env_names", "env_hits")

    def __init__(self, field: str, index: int, container: Json, env: list[Json], env_names: list[str],
                 env_hits: tuple[int, ...]) -> None:
        self.field, self.index, self.container = field, index, container
        self.name: str = container["name"]
        self.is_init = field == "initContainers"
        self.pointer = f"/spec/{field}/{index}"
        self.env, self.env_names, self.env_hits = env, env_names, env_hits


class Desired:
    """What the injected pod carries for one target: volumes, the target's mounts and env, with the
    lookups the patch and the policy make. Shared between requests: never mutate."""

    __slots__ = ("volumes", "mounts", "env", "volumes_by_name", "env_named", "mounts_by_path", "volume_names", "guarded")

    def __init__(self, volumes: tuple[Json, ...], mounts: tuple[Json, ...], env: tuple[Json, ...]) -> None:
        self.volumes, self.mounts, self.env = volumes, mounts, env
        self.volumes_by_name: dict[str, Json] = {v["name"]: v for v in volumes}
        self.env_named: dict[str, Json] = {e["name"]: e for e in env}
        self.mounts_by_path: dict[str, Json] = {m["mountPath"]: m for m in mounts}
        self.volume_names = frozenset(self.volumes_by_name)
        self.guarded = self.volume_names | {GRANT_VOLUME}

    def volume(self, name: str) -> Json | None:
        return self.volumes_by_name.get(name)

    def env_by_name(self) -> dict[str, Json]:
        return dict(self.env_named)


# --- reading the pod -------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _normalised(value: str) -> str:
    cleaned = posixpath.normpath("/" + value)
    return "/" + cleaned.lstrip("/")


def mount_path(value: Any) -> str | None:
    """A mount path as the runtime will resolve it ('/etc/./ld.so.preload' is '/etc/ld.so.preload'),
    or None when it is not a non-empty string."""
    if type(value) is not str or not value:
        return None
    return _normalised(value)


def clean_path(value: Any, where: str) -> str:
    path = mount_path(value)
    if path is None:
        raise PodUnreadable(f"{where}.mountPath must be a non-empty string")
    return path


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
    if not isinstance(annotations, dict) or not set(map(type, annotations.values())) <= {str}:
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


# A mount of one of our volumes: (list field, container index, container, mount index, mount, clean path).
OurMount = tuple[str, int, Json, int, Json, str]


def _check_container(container: Json, field: str, i: int, our_mounts: list[OurMount]) -> None:
    """What we read from every container: its name, its mounts and its security context; the
    mounts of our volumes are kept aside for the patch and the policy."""
    name = container.get("name")
    if type(name) is not str or not name:
        raise PodUnreadable(f"spec.{field}[{i}].name must be a non-empty string")
    mounts = container.get("volumeMounts")
    if mounts is not None:
        for j, mount in enumerate(_list_of_objects(mounts, f"spec.{field}[{i}].volumeMounts")):
            path = mount_path(mount.get("mountPath"))
            if path is None:
                raise PodUnreadable(f"spec.{field}[{i}].volumeMounts[{j}].mountPath must be a non-empty string")
            volume = mount.get("name")
            if type(volume) is not str:
                raise PodUnreadable(f"spec.{field}[{i}].volumeMounts[{j}].name must be a string")
            if volume in OUR_VOLUMES:
                our_mounts.append((field, i, container, j, mount, path))
    security = container.get("securityContext")
    if security is not None and type(security) is not dict:
        raise PodUnreadable(f"spec.{field}[{i}].securityContext must be an object")


_NAME = operator.itemgetter("name")


def scan_env(container: Json, where: str) -> tuple[list[Json], list[str], tuple[int, ...]]:
    """The target's env, its names (checked), and the positions of the names any decision reads.

    C-level passes over the list (env lists run to hundreds of entries); a Python loop only
    when one of the names of interest is there."""
    env = container.get("env")
    if env is None:
        return [], [], ()
    if type(env) is not list:
        raise PodUnreadable(f"{where}.env must be a list of objects")
    try:
        names = list(map(_NAME, env))
    except (KeyError, TypeError):
        names = [e.get("name") for e in _list_of_objects(env, f"{where}.env")]
    try:
        joined = "\0".join(names)  # also the check that every name is a string
    except TypeError:
        bad = next(i for i, n in enumerate(names) if type(n) is not str)
        raise PodUnreadable(f"{where}.env[{bad}].name must be a string") from None
    if ENV_OF_INTEREST.isdisjoint(names) and not _names_a_limit(joined):
        return env, names, ()
    hits = tuple(i for i, n in enumerate(names) if n in ENV_OF_INTEREST or n.startswith(PER_DEVICE_LIMIT_PREFIX))
    return env, names, hits


def _names_a_limit(joined: str) -> bool:
    return joined.startswith(PER_DEVICE_LIMIT_PREFIX) or f"\0{PER_DEVICE_LIMIT_PREFIX}" in joined


def env_names(container: Json, where: str) -> list[str]:
    """The names of a container's env entries, checked."""
    return scan_env(container, where)[1]


class PodView:
    """A Pod checked once for every field the webhook reads."""

    __slots__ = ("pod", "annotations", "spec", "init_containers", "containers", "volumes", "our_mounts", "_all")

    def __init__(self, pod: Json, annotations: dict[str, str], spec: Json, init_containers: list[Json],
                 containers: list[Json], volumes: list[Json] | None, our_mounts: list[OurMount]) -> None:
        self.pod, self.annotations, self.spec = pod, annotations, spec
        self.init_containers, self.containers, self.volumes = init_containers, containers, volumes
        self.our_mounts = our_mounts
        self._all: list[tuple[str, int, Json]] | None = None

    def all_containers(self) -> list[tuple[str, int, Json]]:
        if self._all is None:
            self._all = [("initContainers", i, c) for i, c in enumerate(self.init_containers)] + [
                ("containers", i, c) for i, c in enumerate(self.containers)]
        return self._all


def read_pod(pod: Any, annotations: dict[str, str] | None = None) -> PodView:
    if annotations is None:
        annotations = annotations_of(pod)
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise PodUnreadable("spec is missing or not an object")
    our_mounts: list[OurMount] = []
    lists: list[list[Json]] = []
    for field in ("initContainers", "containers"):
        containers = _list_of_objects(spec.get(field), f"spec.{field}")
        for i, container in enumerate(containers):
            _check_container(container, field, i, our_mounts)
        lists.append(containers)
    volumes = spec.get("volumes")
    for i, volume in enumerate(_list_of_objects(volumes, "spec.volumes")):
        if type(volume.get("name")) is not str:
            raise PodUnreadable(f"spec.volumes[{i}].name must be a string")
    return PodView(pod, annotations, spec, lists[0], lists[1], volumes, our_mounts)


def find_target(view: PodView) -> Target:
    """The fraction container, resolved as KAI-Scheduler does: a named one (init containers
    first), else containers[0]."""
    field, index, container = _resolve_target(view)
    return Target(field, index, container, *scan_env(container, f"spec.{field}[{index}]"))


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


class Shapes:
    """The injected shape under one configuration, built once per target name: every GPU-sharing
    pod of a workload asks for the same one. So does its patch, for a pod that carries nothing of ours."""

    def __init__(self, config: InjectionConfig) -> None:
        self.config = config
        self._built: dict[str, Desired] = {}
        self._clean: dict[tuple[Desired, str, bool, bool, bool], tuple[bytes, int]] = {}

    def clean_patch(self, view: PodView, target: Target, desired: Desired) -> tuple[bytes, int]:
        """`plan_ops` serialised, and how many ops, for a pod where `carries_nothing_of_ours`: they
        depend only on the target's place and on which of the lists the patch extends exist."""
        container = target.container
        key = (desired, target.pointer, view.volumes is None, container.get("volumeMounts") is None, container.get("env") is None)
        patch = self._clean.get(key)
        if patch is None:
            if len(self._clean) >= _DESIRED_PER_CONFIG:
                self._clean.clear()
            ops = plan_ops(view, target, desired)
            patch = self._clean[key] = (orjson.dumps(ops), len(ops))
        return patch

    def desired(self, target: Target) -> Desired:
        key = target.name  # an init-container target gets what a main-container target gets
        desired = self._built.get(key)
        if desired is None:
            if len(self._built) >= _DESIRED_PER_CONFIG:
                self._built.clear()  # names are the pods' to choose: bounded, whatever they send
            desired = self._built[key] = build_desired(target, self.config)
        return desired


def build_desired(target: Target, config: InjectionConfig) -> Desired:
    lib = config.container_vgpu_mount
    volumes: list[Json] = [{"name": VGPU_VOLUME, "hostPath": {"path": lib, "type": "Directory"}}]
    mounts: list[Json] = [
        {"name": VGPU_VOLUME, "mountPath": lib, "readOnly": True},
        {"name": VGPU_VOLUME, "mountPath": PRELOAD_PATH, "subPath": PRELOAD_SUBPATH, "readOnly": True},
    ]
    # An init-container target gets the same grant, state dir and env as a main-container one: without
    # them its library would take the limit from the environment, which the tenant controls.
    per_container = f"$(POD_UID)_{target.name}"
    volumes.append({"name": STATE_VOLUME, "hostPath": {"path": config.state_dir, "type": "DirectoryOrCreate"}})
    # The node agent's grant (root-owned, read-only here): the limits the library obeys whatever the env says.
    volumes.append({"name": GRANT_VOLUME, "hostPath": {"path": config.grant_dir, "type": "DirectoryOrCreate"}})
    mounts.append({"name": STATE_VOLUME, "mountPath": STATE_MOUNT_PATH, "subPathExpr": per_container})
    mounts.append({"name": GRANT_VOLUME, "mountPath": GRANT_MOUNT_PATH, "subPathExpr": per_container, "readOnly": True})
    env = (
        {"name": POD_UID_ENV, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}},
        {"name": CONTAINER_NAME_ENV, "value": target.name},
        {"name": CONTAINER_VGPU_MOUNT_ENV, "value": lib},
        {"name": SHARED_CACHE_ENV, "value": USAGE_CACHE_PATH},
    )
    return Desired(tuple(volumes), tuple(mounts), env)


@functools.lru_cache(maxsize=16)
def shapes_for(config: InjectionConfig) -> Shapes:
    return Shapes(config)


def desired_for(target: Target, config: InjectionConfig) -> Desired:
    return shapes_for(config).desired(target)


def canonical(value: Any) -> Any:
    """Drop fields at their zero value, so `readOnly: false` or `subPath: ""` equals absent."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items() if v not in (None, "", False, [], {})}
    return value


def same(existing: Json, wanted: Json) -> bool:
    return canonical(existing) == canonical(wanted)


# --- the patch -------------------------------------------------------------------------


def _sync_list(path: str, current: list[Json] | None, wanted: tuple[Json, ...], positions: dict[Any, list[int]],
               key: Any) -> list[Op]:
    """Ops that make every wanted item present exactly as wanted, matching items by `key`
    (`positions`: where each key is in `current`).

    A missing list is created whole; a missing item is appended; an item with the same key
    but other content is replaced in place (a duplicate key would be rejected by the API).
    Values are the shared wanted items: serialise them, never mutate them.
    """
    if not wanted:
        return []
    if current is None:
        return [{"op": "add", "path": path, "value": list(wanted)}]
    ops: list[Op] = []
    for item in wanted:
        indices = positions.get(key(item))
        if not indices:
            ops.append({"op": "add", "path": f"{path}/-", "value": item})
        else:
            ops.extend({"op": "replace", "path": f"{path}/{i}", "value": item} for i in indices if not same(current[i], item))
    return ops


def _positions(keys: Any) -> dict[Any, list[int]]:
    """Where each key is in a list, from (index, key) pairs."""
    positions: dict[Any, list[int]] = {}
    for i, k in keys:
        positions.setdefault(k, []).append(i)
    return positions


def _name_key(item: Json) -> Any:
    return item.get("name")


def _mount_key(mount: Json) -> str:
    return clean_path(mount.get("mountPath"), "volumeMount")


def plan_ops(view: PodView, target: Target, desired: Desired) -> list[Op]:
    """Volumes, then the target's mounts, then its env (upstream's order), then read-only
    fixes for other mounts of our volumes. Empty when the pod is already injected. The values
    are shared with `desired`."""
    volumes, mounts = view.volumes, target.container.get("volumeMounts")
    ops = _sync_list("/spec/volumes", volumes, desired.volumes, _positions(enumerate(map(_name_key, volumes or ()))), _name_key)
    ops += _sync_list(f"{target.pointer}/volumeMounts", mounts, desired.mounts,
                      _positions(enumerate(map(_mount_key, mounts or ()))), _mount_key)
    names = target.env_names
    env_positions = _positions((i, names[i]) for i in target.env_hits)
    ops += _sync_list(f"{target.pointer}/env", target.container.get("env"), desired.env, env_positions, _name_key)
    if view.our_mounts:
        ops += _read_only_fixes(view, target, desired)
    return ops


def carries_nothing_of_ours(view: PodView, target: Target, desired: Desired) -> bool:
    """No volume, mount or env entry the patch would match: it only adds, the same for every such pod."""
    if view.our_mounts or any(target.env_names[i] in desired.env_named for i in target.env_hits):
        return False
    if view.volumes and not desired.volume_names.isdisjoint(map(_name_key, view.volumes)):
        return False
    mounts = target.container.get("volumeMounts") or ()
    return not any(mount_path(m.get("mountPath")) in desired.mounts_by_path for m in mounts)


def patch_ops(view: PodView, target: Target, config: InjectionConfig, desired: Desired | None = None) -> list[Op]:
    """`plan_ops` with values of their own, for callers that apply or change the patch."""
    ops = plan_ops(view, target, desired or desired_for(target, config))
    return orjson.loads(orjson.dumps(ops))  # type: ignore[no-any-return]


def _read_only_fixes(view: PodView, target: Target, desired: Desired) -> list[Op]:
    """Any other mount of a volume we define becomes read-only: the library dir is the node's,
    and the state dir holds every container's accounting; nobody may write under the grant's name."""
    ops: list[Op] = []
    for field, index, _container, j, mount, path in view.our_mounts:
        if mount["name"] not in desired.guarded or mount.get("readOnly") is True:
            continue
        if field == target.field and index == target.index and path in desired.mounts_by_path:
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
