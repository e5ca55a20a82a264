"""Tenant-escape policy: what in a GPU-sharing pod tries to get around libvgpu.so, what in any other pod asks the
NVIDIA runtime for a GPU it was never given, and what to do about it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kai_isolator.shared.contract import GRANT_MOUNT_PATH, KAI_CONFIGMAP_ANNOTATION, PRELOAD_PATH, STATE_MOUNT_PATH

from .injection import Desired, InjectionConfig
from .pod import (
    ESCAPE_ENV, GRANT_ENV, PER_DEVICE_LIMIT_PREFIX, Json, PodView, Target, clean_path, is_within, mount_path, same,
)
from .settings import PolicyMode

__all__ = ["ESCAPE_ENV", "GRANT_ENV", "PER_DEVICE_LIMIT_PREFIX", "Verdict", "device_access_findings", "findings", "judge"]
# Seccomp profiles that keep the tenant from making a user namespace (and remounting the preload in it).
CONFINING_SECCOMP = frozenset({"RuntimeDefault", "Localhost"})
# Capabilities that let a process remount /etc/ld.so.preload or leave the container's view.
ESCAPE_CAPABILITIES = frozenset({"ALL", "SYS_ADMIN", "SYS_PTRACE", "SYS_MODULE"})
# The NVIDIA container runtime's device selector, and the values that give a container no GPU.
DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
NO_DEVICES = frozenset({"", "void", "none"})
# What the device plugin hands out: a container asking for one gets its GPUs from the plugin, not from its own env.
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
_ZERO_QUANTITY = re.compile(r"^\+?0*(\.0*)?([eE][+-]?[0-9]+|[a-zA-Z]+)?$")


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    warnings: tuple[str, ...] = ()
    message: str = ""


ALLOWED = Verdict(True)


def findings(view: PodView, target: Target, desired: Desired, config: InjectionConfig) -> list[str]:
    """Every escape attempt in the pod as it was submitted, one line each."""
    found = _target_findings(target, desired, config, view.annotations)
    found += _other_container_findings(view, target)
    found += _seccomp_findings(view, target)
    found += _volume_findings(view.volumes or [], desired, config)
    if view.our_mounts:
        found += _foreign_mount_findings(view, target, desired)
    return found


def _target_findings(target: Target, desired: Desired, config: InjectionConfig, view_annotations: dict[str, str]) -> list[str]:
    name, container = target.name, target.container
    found: list[str] = []
    managed = desired.env_named
    env, names = target.env, target.env_names
    for i in target.env_hits:  # the scan found every name read here; most pods set none of them
        var = names[i]
        wanted = managed.get(var)
        if var in ESCAPE_ENV:
            found.append(f"container {name} sets {var}")
        elif wanted is not None:
            if not same(env[i], wanted):
                found.append(f"container {name} sets {var} itself (the webhook owns it)")
        elif var in GRANT_ENV or (var.startswith(PER_DEVICE_LIMIT_PREFIX) and var[len(PER_DEVICE_LIMIT_PREFIX):].isdigit()):
            found.append(f"container {name} sets {var}, which would move the limits, devices or accounting the node's grant fixes")
    foreign = foreign_env_from(container.get("envFrom"), kai_env_from(view_annotations, target))
    if foreign:
        # The webhook cannot see what a ConfigMap or Secret will hold at start: it may set any of the above.
        found.append(f"container {name} takes env from envFrom sources the webhook cannot check ({', '.join(foreign)})")
    security = _object(container.get("securityContext"))
    if security.get("privileged") is True:
        found.append(f"container {name} is privileged and would see every GPU")
    added_list = _object(security.get("capabilities")).get("add")
    added = {str(c).upper().removeprefix("CAP_") for c in added_list} if isinstance(added_list, list) else set()
    for capability in sorted(added & ESCAPE_CAPABILITIES):
        found.append(f"container {name} adds capability {capability}, enough to undo the preload")
    own = desired.mounts_by_path
    for mount in container.get("volumeMounts") or ():
        path = mount_path(mount.get("mountPath")) or ""  # checked by read_pod
        if path in own and same(mount, own[path]):
            continue
        if path == PRELOAD_PATH:
            found.append(f"container {name} mounts its own {PRELOAD_PATH} (volume {mount.get('name')})")
        elif is_within(path, config.container_vgpu_mount):
            found.append(f"container {name} mounts volume {mount.get('name')} over the library directory at {path}")
        elif is_within(path, STATE_MOUNT_PATH):
            found.append(f"container {name} mounts volume {mount.get('name')} over its state directory at {path}")
        elif is_within(path, GRANT_MOUNT_PATH):
            found.append(f"container {name} mounts volume {mount.get('name')} over its grant directory at {path}")
    return found


def kai_env_from(annotations: dict[str, str], target: Target) -> Json | None:
    """The one envFrom KAI-Scheduler's admission (gpusharing) gives the fraction container, or None before it named
    its ConfigMaps: `<runai/shared-gpu-configmap>-<index>-evar` (`i<index>` for an init container), not optional.

    Accepting it trusts nothing in it: the tenant may write that annotation itself, and may edit (or create first) a
    ConfigMap of that name in its namespace, so what it holds is the tenant's, like any env. It is accepted because
    KAI needs it, and because the target runs under the node's grant, which the webhook mounts on this very container:
    there libvgpu.so takes limits, devices and accounting from grant.json and reads from the environment only
    VGPU_GRANT_WAIT_SECONDS (how long to wait for the grant; the outcome is fail-closed either way) and
    LIBCUDA_LOG_LEVEL. What else the env still moves is not the library's: LD_PRELOAD and LD_AUDIT (ld.so), which
    the tenant can set in its own command line anyway and which the node's enforcer answers, and NVIDIA_VISIBLE_DEVICES
    (the container runtime), which KAI's own `env` entry for that name overrides once KAI has admitted the pod (env
    wins over envFrom); a pod KAI never admits gets no grant from the node agent, so its library refuses every
    allocation on whatever device it names.
    """
    prefix = annotations.get(KAI_CONFIGMAP_ANNOTATION)
    if not prefix:
        return None
    index = f"i{target.index}" if target.is_init else str(target.index)
    return {"configMapRef": {"name": f"{prefix}-{index}-evar", "optional": False}}


def foreign_env_from(sources: object, kais: Json | None) -> list[str]:
    """Each envFrom source that is not exactly KAI's, as `configMapRef <name>` / `secretRef <name>` (`prefix` noted)."""
    if not isinstance(sources, list):
        return [] if not sources else ["unreadable envFrom"]
    foreign: list[str] = []
    for source in sources:
        if kais is not None and isinstance(source, dict) and same(source, kais):
            continue
        foreign.append(_describe_source(source))
    return foreign


def _describe_source(source: object) -> str:
    if not isinstance(source, dict):
        return "an unreadable source"
    for kind in ("configMapRef", "secretRef"):
        ref = source.get(kind)
        if isinstance(ref, dict):
            text = f"{kind} {ref.get('name')}"
            if ref.get("optional") is True:
                text += " (optional)"
            return text + (f" with prefix {source['prefix']!r}" if source.get("prefix") else "")
    return "a source of no known kind"


def _other_container_findings(view: PodView, target: Target) -> list[str]:
    """Every container of the pod besides the target: the node grants it no GPU memory, so it must not
    ask the runtime for a GPU, see every GPU, or be able to reach into the target."""
    found: list[str] = []
    for field, index, container in view.all_containers():
        if field == target.field and index == target.index:
            continue
        name = container["name"]
        if names_devices(container):
            found.append(f"container {name} sets {DEVICES_ENV}: only the GPU-share target ({target.name}) may reach the GPU, "
                         "and the node grants the others nothing")
        if container.get("envFrom"):
            found.append(f"container {name} takes env from envFrom sources the webhook cannot check (they may set {DEVICES_ENV})")
        security = _object(container.get("securityContext"))
        if security.get("privileged") is True:
            found.append(f"container {name} is privileged and would see every GPU")
        added_list = _object(security.get("capabilities")).get("add")
        added = {str(c).upper().removeprefix("CAP_") for c in added_list} if isinstance(added_list, list) else set()
        for capability in sorted(added & ESCAPE_CAPABILITIES):
            found.append(f"container {name} adds capability {capability}, enough to reach into the target and undo its preload")
    return found


def names_devices(container: Json) -> bool:
    """The container's own env asks the NVIDIA runtime for GPUs: NVIDIA_VISIBLE_DEVICES set to anything but "", `void` or
    `none`, or from a reference whose value the webhook cannot see (KAI's deviceaccess refuses `valueFrom` likewise).
    The last definition is the one the container gets, as the kubelet resolves a name given twice."""
    last = None
    for item in container.get("env") or ():
        if isinstance(item, dict) and item.get("name") == DEVICES_ENV:
            last = item
    if last is None:
        return False
    value = last.get("value")
    return last.get("valueFrom") is not None or not isinstance(value, str) or value.strip().lower() not in NO_DEVICES


def asks_device_plugin(container: Json) -> bool:
    """The container asks the device plugin for a whole GPU or a MIG slice (a non-zero limit or request)."""
    resources = _object(container.get("resources"))
    for amounts in (_object(resources.get("limits")), _object(resources.get("requests"))):
        for name, amount in amounts.items():
            if (name == GPU_RESOURCE or str(name).startswith(MIG_RESOURCE_PREFIX)) and not _is_zero(amount):
                return True
    return False


def _is_zero(amount: object) -> bool:
    """A resource quantity of zero in any of its spellings (`0`, `0.0`, `0m`, `0Gi`, `0e3`): the plugin allocates nothing."""
    return _ZERO_QUANTITY.match(str(amount).strip()) is not None


def device_access_findings(view: PodView) -> list[str]:
    """A pod outside GPU sharing: each container that asks no device plugin for a GPU but names GPUs for the NVIDIA
    runtime itself. With the runtime's env-var device list (the GPU Operator's default) that container would get
    every GPU it names, a shared one included, past the scheduler, the device plugin and every grant. A container that
    asks for `nvidia.com/gpu` is out of scope (the device plugin sets its devices). What the webhook cannot see is the
    node's to judge: env from `envFrom` sources and the image's own ENV (see docs/security.md)."""
    found: list[str] = []
    for _field, _index, container in view.all_containers():
        if names_devices(container) and not asks_device_plugin(container):
            found.append(f"container {container['name']} sets {DEVICES_ENV} but asks for no {GPU_RESOURCE} and the pod shares no GPU: "
                         "it would reach GPUs no one gave it (set it to void, or ask for the GPU)")
    return found


def _seccomp_findings(view: PodView, target: Target) -> list[str]:
    """A target must run under a confining seccomp profile; the container's own setting overrides the pod's."""
    container_profile = _object(_object(target.container.get("securityContext")).get("seccompProfile")).get("type")
    pod_profile = _object(_object(view.spec.get("securityContext")).get("seccompProfile")).get("type")
    profile = container_profile or pod_profile
    if isinstance(profile, str) and profile in CONFINING_SECCOMP:
        return []
    why = ("lets the tenant create a user namespace and remount /etc/ld.so.preload or the library inside it; "
           "set securityContext.seccompProfile.type RuntimeDefault or Localhost")
    if not profile:
        return [f"container {target.name} has no seccomp profile (Unconfined unless the kubelet defaults one), which {why}"]
    return [f"container {target.name} runs with seccomp profile {profile}, which {why}"]


def _object(value: object) -> Json:
    return value if isinstance(value, dict) else {}


def _volume_findings(volumes: list[Json], desired: Desired, config: InjectionConfig) -> list[str]:
    found: list[str] = []
    guarded_dirs = (config.container_vgpu_mount, config.state_dir, config.grant_dir)
    for volume in volumes:
        name = volume["name"]
        wanted = desired.volumes_by_name.get(name)
        if wanted is not None:
            if not same(volume, wanted):
                found.append(f"volume {name} is defined by the pod, not by the webhook")
            continue
        host_path = (volume.get("hostPath") or {}).get("path") if isinstance(volume.get("hostPath"), dict) else None
        if isinstance(host_path, str) and host_path.startswith("/"):
            path = clean_path(host_path, f"volume {name}.hostPath")
            if any(is_within(path, d) or is_within(d, path) for d in guarded_dirs):
                found.append(f"volume {name} exposes the node path {path} by hostPath")
    return found


def _foreign_mount_findings(view: PodView, target: Target, desired: Desired) -> list[str]:
    found: list[str] = []
    for field, index, container, _j, mount, path in view.our_mounts:
        volume = mount["name"]
        if volume not in desired.volume_names:
            continue
        if field == target.field and index == target.index and path in desired.mounts_by_path:
            continue
        if mount.get("readOnly") is not True:
            found.append(f"container {container['name']} mounts {volume} writable at {path}")
        elif volume != desired.volumes[0]["name"]:
            found.append(f"container {container['name']} mounts {volume} at {path}; only the target's own state and grant directories may be")
    return found


def judge(found: list[str], mode: PolicyMode, what: str = "this GPU-sharing pod") -> Verdict:
    if not found or mode == "off":
        return ALLOWED
    if mode == "warn":
        return Verdict(True, tuple(f"kai-resource-isolator: {f}" for f in found))
    return Verdict(False, message=f"kai-resource-isolator denies {what}: " + "; ".join(found))
