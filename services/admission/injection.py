"""What the webhook injects into a GPU-sharing pod for one target container under one configuration: the
volumes, the target's mounts and its env. The policy judges a pod against it; the patch brings the pod to it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kai_isolator.shared.contract import (
    CONTAINER_NAME_ENV, CONTAINER_VGPU_MOUNT_ENV, DEFAULT_GRANT_DIR, DEFAULT_STATE_DIR, DEFAULT_VGPU_MOUNT, GRANT_MOUNT_PATH,
    GRANT_VOLUME, POD_UID_ENV, PRELOAD_PATH, PRELOAD_SUBPATH, SHARED_CACHE_ENV, STATE_MOUNT_PATH, STATE_VOLUME,
    USAGE_CACHE_PATH, VGPU_VOLUME,
)

from .pod import Json, Target

_DESIRED_PER_CONFIG = 4096


@dataclass(frozen=True)
class InjectionConfig:
    container_vgpu_mount: str = DEFAULT_VGPU_MOUNT
    state_dir: str = DEFAULT_STATE_DIR
    allow_pod_opt_out: bool = True
    grant_dir: str = DEFAULT_GRANT_DIR


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


class Shapes:
    """The injected shape under one configuration, built once per target name: every GPU-sharing
    pod of a workload asks for the same one."""

    def __init__(self, config: InjectionConfig) -> None:
        self.config = config
        self._built: dict[str, Desired] = {}

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
