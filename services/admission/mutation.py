"""The patch: the RFC 6902 operations that bring a pod, as read, to the injected shape (only what is missing or
wrong), and the readiness gate."""

from __future__ import annotations

from typing import Any

import orjson

from kai_isolator.shared.operator_view import ISOLATED_CONDITION

from .injection import Desired, InjectionConfig, desired_for
from .pod import Json, PodView, Target, clean_path, list_of_objects, mount_path, same

Op = dict[str, Any]
_CLEAN_PATCHES_KEPT = 4096


class CleanPatches:
    """The patch of a pod that carries nothing of ours, serialised once per shape: every GPU-sharing pod of a
    workload gets the same one."""

    def __init__(self) -> None:
        self._clean: dict[tuple[Desired, str, bool, bool, bool], tuple[bytes, int]] = {}

    def clean_patch(self, view: PodView, target: Target, desired: Desired) -> tuple[bytes, int]:
        """`plan_ops` serialised, and how many ops, for a pod where `carries_nothing_of_ours`: they
        depend only on the target's place and on which of the lists the patch extends exist."""
        container = target.container
        key = (desired, target.pointer, view.volumes is None, container.get("volumeMounts") is None, container.get("env") is None)
        patch = self._clean.get(key)
        if patch is None:
            if len(self._clean) >= _CLEAN_PATCHES_KEPT:
                self._clean.clear()
            ops = plan_ops(view, target, desired)
            patch = self._clean[key] = (orjson.dumps(ops), len(ops))
        return patch


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
    gates = list_of_objects(view.spec.get("readinessGates"), "spec.readinessGates")
    gate = {"conditionType": ISOLATED_CONDITION}
    if any(g.get("conditionType") == ISOLATED_CONDITION for g in gates):
        return []
    if "readinessGates" not in view.spec:
        return [{"op": "add", "path": "/spec/readinessGates", "value": [gate]}]
    return [{"op": "add", "path": "/spec/readinessGates/-", "value": gate}]


REQUIRED_PLUGINS = "required-plugins.noderesource.dev"  # NRI's annotation (pkg/plugin.RequiredPluginsAnnotation)


def required_plugin_ops(view: PodView, plugin: str) -> list[Op]:
    """Ops that make every container of the pod require NRI plugin `plugin`: containerd's default validator then
    refuses to create it on a node where the plugin is not registered (the agent's plugin gone = fail closed). Set per
    container (`.../container.<name>`), the scope NRI reads first, so a tenant's own container-scoped value (an empty
    list) is overwritten rather than winning over a pod-scoped one."""
    wanted = orjson.dumps([plugin]).decode()
    annotations = view.annotations
    ops: list[Op] = []
    if not isinstance((view.pod.get("metadata") or {}).get("annotations"), dict):
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    for _field, _index, container in view.all_containers():
        key = f"{REQUIRED_PLUGINS}/container.{container.get('name')}"
        if annotations.get(key) != wanted:
            ops.append({"op": "add", "path": "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1"), "value": wanted})
    return ops
