"""What the agent observes on its node: the self-check of the active library, one
container's processes (for inspect requests; found by cgroup, judged by device and inode)
and every container's usage.cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel

from kai_isolator.shared import usage_cache
from kai_isolator.shared.cgroups import container_id_from_status, container_of_pid
from kai_isolator.shared.contract import (
    DEFAULT_GRANT_DIR, GRANT_MOUNT_PATH, LIMIT_ENV, PRELOAD_PATH, SHARED_CACHE_ENV, STATE_MOUNT_PATH,
)
from kai_isolator.shared.events import DeviceUsage, InspectReply, InspectRequest, PodRef, ProcessReport, ProcessUsage, utcnow

from . import procscan
from .install import installed_versions, status
from .layout import LIBRARY_LINK, HostLayout

_POD_UID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_CONTAINER = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_CONTAINER_ID = re.compile(r"^[0-9a-f]{64}$")
_MAPS_PROBE = "import sys; sys.stdout.write(open('/proc/self/maps').read())"


class SelfCheck(BaseModel):
    passed: bool
    at: datetime
    message: str


def self_check(layout: HostLayout, command: list[str] | None, timeout_s: float) -> SelfCheck:
    """The installed files are consistent, and a new process really maps the active library."""
    state = status(layout)
    if not state.installed or state.active_version is None:
        return SelfCheck(passed=False, at=utcnow(), message="; ".join(state.problems) or "not installed")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LD_PRELOAD": str(layout.link)}
    argv = command or [sys.executable, "-I", "-c", _MAPS_PROBE]
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return SelfCheck(passed=False, at=utcnow(), message=f"probe {argv[0]} did not run: {error}")
    if proc.returncode != 0 or "cannot be preloaded" in proc.stderr:
        return SelfCheck(passed=False, at=utcnow(), message=f"probe exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    if command is None:
        expected = os.path.realpath(layout.library(state.active_version))
        if expected not in proc.stdout:
            return SelfCheck(passed=False, at=utcnow(), message=f"a preloaded process does not map {expected}")
    return SelfCheck(passed=True, at=utcnow(), message=f"libvgpu.so.{state.active_version} loads in a new process")


# --- inspect ---------------------------------------------------------------------------------


@dataclass
class ContainerView:
    found: bool
    processes: list[ProcessReport]
    devices: list[DeviceUsage]
    message: str = ""
    tampering: list[str] = field(default_factory=list)


def reply_to(layout: HostLayout, proc_root: Path, request: InspectRequest, node: str, installed: str | None) -> InspectReply:
    """The agent's answer to an inspect request."""
    view = inspect_container(layout, proc_root, request.pod, request.container, request.container_id)
    return InspectReply(node_name=node, pod=request.pod, container=request.container, found=view.found,
                        processes=view.processes, devices=view.devices, installed_version=installed, message=view.message,
                        usage_cache_tampered=view.tampering)


def inspect_container(layout: HostLayout, proc_root: Path, pod: PodRef, container: str, container_id: str = "") -> ContainerView:
    """Every host process of the container, found by the cgroup the kubelet put it in (never by
    anything in its environment), and what each really maps and sees, by device and inode."""
    container_id = container_id_from_status(container_id)
    if not _POD_UID.match(pod.uid) or not _CONTAINER.match(container) or (container_id and not _CONTAINER_ID.match(container_id)):
        return ContainerView(False, [], [], "pod uid and container name must be Kubernetes names (and a container id 64 hex digits)")
    pids, problem = container_pids(proc_root, pod.uid, container, container_id)
    own = _Identities.of(layout, pod.uid, container)
    reports: list[ProcessReport] = []
    cache_roots: list[tuple[Path, str]] = [(layout.containers_dir, f"{pod.uid}_{container}/usage.cache")]
    cache_maps: list[tuple[int, procscan.MappedFile]] = []
    for pid in pids:
        maps = procscan.mapped_files(proc_root, pid)
        if maps is None:
            continue  # exited while we looked: a normal answer, just not this process
        env = procscan.environ(proc_root, pid) or {}
        root = proc_root / str(pid) / "root"
        version, decoy = _mapped_library(maps, own.libraries)
        preload_id = procscan.identity_in_root(root, PRELOAD_PATH)
        reports.append(ProcessReport(
            pid=pid, preload=procscan.read_in_root(root, PRELOAD_PATH),
            preload_ours=preload_id is not None and preload_id == own.preload,
            library_mapped=version is not None, library_version=version, library_not_ours=decoy,
            memory_limit_env=env.get(LIMIT_ENV),
            grant_mounted=own.grant_dir is not None and procscan.identity_in_root(root, GRANT_MOUNT_PATH) == own.grant_dir,
        ))
        # The library maps nothing else from the state dir; a renamed file cannot leave that mount.
        cache_maps += [(pid, m) for m in maps if m.path.startswith(f"{STATE_MOUNT_PATH}/") or (m.device, m.inode) == own.cache]
        if env.get(SHARED_CACHE_ENV):
            cache_roots.append((root, env[SHARED_CACHE_ENV]))  # an upstream layout without our state mount
    devices, message = _first_usage(cache_roots)
    tampering = _tampering(layout, proc_root, pod.uid, container, own.cache, cache_maps) if reports else []
    if not reports:
        message = "; ".join(m for m in ("no running process of this container on the node", problem, message) if m)
    return ContainerView(bool(reports), reports, devices, message, tampering)


def container_pids(proc_root: Path, pod_uid: str, container: str, container_id: str = "") -> tuple[list[int], str]:
    """Host pids in the container's kubelet cgroup: by its runtime id when known, else the one of
    the pod's containers that mounts `<pod uid>_<container>` (its state or grant dir)."""
    by_id: dict[str, list[int]] = {}
    for pid in procscan.pids(proc_root):
        found = container_of_pid(pid, proc_root)
        if found is not None and found.pod_uid == pod_uid:
            by_id.setdefault(found.container_id, []).append(pid)
    if container_id:
        return by_id.get(container_id, []), ""
    subdir = f"{pod_uid}_{container}"
    named = [cid for cid, pids in by_id.items() if _mounts_subdir(proc_root, pids, subdir)]
    if len(named) == 1:
        return by_id[named[0]], ""
    if not named and len(by_id) == 1:
        return next(iter(by_id.values())), ""
    if by_id:
        return [], f"{len(by_id)} containers of the pod run here and {len(named)} mount {subdir}: which one is {container} is unknown"
    return [], ""


def _mounts_subdir(proc_root: Path, pids: list[int], subdir: str) -> bool:
    for pid in pids:
        roots = procscan.mount_roots(proc_root, pid)
        if roots is not None:
            return any(root.rstrip("/").endswith(f"/{subdir}") for root in roots.values())
    return False


@dataclass(frozen=True)
class _Identities:
    """(device, inode) of what the node installed for one container: the only things that count as ours."""

    libraries: dict[procscan.Identity, str]
    preload: procscan.Identity | None
    grant_dir: procscan.Identity | None
    cache: procscan.Identity | None

    @classmethod
    def of(cls, layout: HostLayout, pod_uid: str, container: str) -> _Identities:
        subdir = f"{pod_uid}_{container}"
        libraries = {}
        for version in installed_versions(layout):
            ident = procscan.identity(layout.library(version))
            if ident:
                libraries[ident] = version
        return cls(libraries, procscan.identity(layout.preload),
                   procscan.identity_in_root(layout.host_root / DEFAULT_GRANT_DIR.lstrip("/"), subdir),
                   procscan.identity_in_root(layout.containers_dir, f"{subdir}/usage.cache"))


def _mapped_library(maps: list[procscan.MappedFile], ours: dict[procscan.Identity, str]) -> tuple[str | None, str | None]:
    """(our version it maps, else None; the path of a mapped file named like ours that is not ours)."""
    decoy = None
    for mapped in maps:
        if (mapped.device, mapped.inode) in ours:
            return ours[(mapped.device, mapped.inode)], None
        if os.path.basename(mapped.path).startswith(LIBRARY_LINK):
            decoy = decoy or mapped.path
    return None, decoy


# --- tampering with the accounting file --------------------------------------------------------

_SLOTS_BASE = 64 + usage_cache.DEVICES * 128  # shm_layout.h: header, then device records, then slots
_SLOT_BYTES = (usage_cache.FILE_SIZE - _SLOTS_BASE) // usage_cache.SLOTS
_RECHECK_S = 0.05


def _tampering(layout: HostLayout, proc_root: Path, pod_uid: str, container: str, cache: procscan.Identity | None,
               cache_maps: list[tuple[int, procscan.MappedFile]]) -> list[str]:
    """What shows the container's accounting file was changed behind the library's back.

    Only files some live process of the container maps are judged (the library has then
    initialised them); each finding is confirmed by a second look, so an update in flight
    is never taken for tampering.
    """
    if not cache_maps:
        return []
    found = []
    for pid, mapped in cache_maps:
        if mapped.deleted:
            found.append(f"pid {pid} maps an accounting file that was deleted")
        elif (mapped.device, mapped.inode) != cache:
            found.append(f"pid {pid} maps an accounting file that was replaced by another one")
    path = f"{pod_uid}_{container}/usage.cache"
    first = _file_findings(layout, proc_root, path, cache, cache_maps)
    if first:
        time.sleep(_RECHECK_S)
        again = _file_findings(layout, proc_root, path, cache, cache_maps)
        found += [finding for finding in first if finding in again]
    return sorted(set(found))


def _file_findings(layout: HostLayout, proc_root: Path, path: str, cache: procscan.Identity | None,
                   cache_maps: list[tuple[int, procscan.MappedFile]]) -> list[str]:
    if cache is None:
        return []  # gone: its mappings say so
    try:
        snapshot = read_cache_in_root(layout.containers_dir, path)
    except usage_cache.TornReadError:
        return []
    except (OSError, usage_cache.UsageCacheError) as error:
        return [f"the accounting file is no longer valid: {error}"]
    found = []
    for device in snapshot.devices:
        held = sum(p.used_bytes.get(device.index, 0) for p in snapshot.processes)
        if device.used_bytes != held:
            found.append(f"device {device.index}: total {device.used_bytes} bytes, but its processes hold {held}")
    found += _wiped_slots(layout, proc_root, path, cache, {pid for pid, m in cache_maps if (m.device, m.inode) == cache})
    return found


def _wiped_slots(layout: HostLayout, proc_root: Path, path: str, cache: procscan.Identity, pids: set[int]) -> list[str]:
    """A live process holds the lock of its slot all its life: a locked slot that names nobody,
    or someone else, was overwritten."""
    found = []
    try:
        with procscan.open_in_root(layout.containers_dir, path) as fd:
            for pid in sorted(pids):
                me = procscan.namespaced_pid(proc_root, pid)
                for device, inode, first, last in procscan.file_locks(proc_root, pid):
                    if (device, inode) != cache or first < _SLOTS_BASE or last - first + 1 != _SLOT_BYTES:
                        continue
                    named = int.from_bytes(os.pread(fd, 4, first), "little", signed=True)
                    if named != me:
                        found.append(f"pid {pid}'s slot {(first - _SLOTS_BASE) // _SLOT_BYTES} was overwritten (names pid {named})")
    except OSError:
        return []
    return found


def _first_usage(candidates: list[tuple[Path, str]]) -> tuple[list[DeviceUsage], str]:
    problem = ""
    for root, path in candidates:
        try:
            snapshot = read_cache_in_root(root, path)
        except (OSError, usage_cache.UsageCacheError) as error:
            problem = f"usage cache: {error}"
            continue
        return device_usage(snapshot), ""
    return [], problem


def read_cache_in_root(root: Path, path: str) -> usage_cache.UsageSnapshot:
    """read_usage on a file reached only inside `root` (tenants control both the env and the directory)."""
    with procscan.open_in_root(root, path) as fd:
        return usage_cache.read_usage(f"/proc/self/fd/{fd}", shown_as=path)


def device_usage(snapshot: usage_cache.UsageSnapshot) -> list[DeviceUsage]:
    """Devices the container has used or that NVML named; device 0 when it has done nothing yet."""
    devices = [d for d in snapshot.devices if d.uuid or d.used_bytes] or snapshot.devices[:1]
    return [DeviceUsage(index=d.index, uuid=d.uuid, limit_bytes=d.limit_bytes or 0, used_bytes=d.used_bytes,
                        unlimited=d.limit_bytes is None) for d in devices]


def process_usage(snapshot: usage_cache.UsageSnapshot) -> list[ProcessUsage]:
    return [ProcessUsage(pid=p.pid, device=dev, used_bytes=used) for p in snapshot.processes for dev, used in p.used_bytes.items()]


# --- usage of every container -------------------------------------------------------------------


@dataclass
class ContainerUsage:
    pod_uid: str
    container: str
    devices: list[DeviceUsage]
    processes: list[ProcessUsage]


def scan_usage(layout: HostLayout) -> list[ContainerUsage]:
    """Every readable `<pod uid>_<container>/usage.cache` in the state dir and (upstream layout) the library dir."""
    found: dict[tuple[str, str], ContainerUsage] = {}
    for base in (layout.containers_dir, layout.install_dir / "containers"):
        try:
            entries = sorted(os.listdir(base))
        except OSError:
            continue
        for entry in entries:
            uid, sep, container = entry.partition("_")
            if not sep or not _POD_UID.match(uid) or not _CONTAINER.match(container) or (uid, container) in found:
                continue
            try:
                snapshot = read_cache_in_root(base, f"{entry}/usage.cache")
            except (OSError, usage_cache.UsageCacheError):
                continue  # not created yet (no CUDA call so far), or not a cache we can trust
            found[(uid, container)] = ContainerUsage(uid, container, device_usage(snapshot), process_usage(snapshot))
    return list(found.values())
