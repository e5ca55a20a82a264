"""Reading a pod once: the checked view of every field the webhook reads, the fraction container, and comparing
values as the API server does. The policy and the patch both read the pod through this, and nothing else."""

from __future__ import annotations

import functools
import operator
import posixpath
from typing import Any

from kai_isolator.shared.contract import (
    CONTAINER_NAME_ENV, CONTAINER_VGPU_MOUNT_ENV, FRACTION_CONTAINER_ANNOTATION as CONTAINER_NAME_ANNOTATION,
    GPU_FRACTION_ANNOTATION, GPU_MEMORY_ANNOTATION, GPU_REQUEST_ANNOTATIONS, GRANT_VOLUME, INJECT_ANNOTATION, LIMIT_ENV,
    POD_UID_ENV, SHARED_CACHE_ENV, STATE_VOLUME, VGPU_VOLUME, gpu_group_labels,
)
from kai_isolator.shared.errors import IsolatorError

Json = dict[str, Any]

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


class PodUnreadable(IsolatorError):
    """`request.object` claims to be a Pod but lacks the shape we must read."""


class NoTargetContainer(IsolatorError):
    """The fraction container cannot be resolved (no containers, or the named one is absent)."""


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


def changed_gpu_requests(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Each GPU-request annotation an update adds, removes or changes, as `key: 'old' -> 'new'` (None for absent)."""
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in GPU_REQUEST_ANNOTATIONS if old.get(key) != new.get(key)]


def changed_gpu_groups(old: Any, new: Any) -> list[str]:
    """Each GPU-group label an update of a bound pod adds, removes or changes, as `key: 'old' -> 'new'`. KAI's binder
    labels the pod before it binds it, and takes the labels off only when that bind fails; once bound, the node grants
    the GPUs KAI reserved for exactly these groups."""
    spec = old.get("spec") if isinstance(old, dict) else None
    if not isinstance(spec, dict) or not spec.get("nodeName"):
        return []
    before, after = _gpu_group_labels(old), _gpu_group_labels(new)
    return [f"label {key}: {before.get(key)!r} -> {after.get(key)!r}" for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]


def _gpu_group_labels(pod: Any) -> dict[str, str]:
    labels = (pod.get("metadata") or {}).get("labels") if isinstance(pod, dict) else None
    if labels is None:
        return {}
    if not isinstance(labels, dict) or not set(map(type, labels.values())) <= {str}:
        raise PodUnreadable("metadata.labels must map strings to strings")
    return gpu_group_labels(labels)


def asks_opt_out(annotations: dict[str, str]) -> bool:
    return annotations.get(INJECT_ANNOTATION, "").lower() == "false"


def list_of_objects(value: Any, where: str) -> list[Json]:
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
        for j, mount in enumerate(list_of_objects(mounts, f"spec.{field}[{i}].volumeMounts")):
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
        names = [e.get("name") for e in list_of_objects(env, f"{where}.env")]
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
        containers = list_of_objects(spec.get(field), f"spec.{field}")
        for i, container in enumerate(containers):
            _check_container(container, field, i, our_mounts)
        lists.append(containers)
    volumes = spec.get("volumes")
    for i, volume in enumerate(list_of_objects(volumes, "spec.volumes")):
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


def canonical(value: Any) -> Any:
    """Drop fields at their zero value, so `readOnly: false` or `subPath: ""` equals absent."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items() if v not in (None, "", False, [], {})}
    return value


def same(existing: Json, wanted: Json) -> bool:
    return canonical(existing) == canonical(wanted)
