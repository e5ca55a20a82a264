"""What the agent observes on its node: the self-check of the active library, one
container's processes (for inspect requests) and every container's usage.cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel

from kai_isolator.shared import usage_cache
from kai_isolator.shared.events import DeviceUsage, InspectReply, InspectRequest, PodRef, ProcessReport, ProcessUsage, utcnow

from . import procscan
from .install import installed_versions, status
from .layout import LIBRARY_LINK, HostLayout, version_from_name

_POD_UID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_CONTAINER = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
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


def reply_to(layout: HostLayout, proc_root: Path, request: InspectRequest, node: str, installed: str | None) -> InspectReply:
    """The agent's answer to an inspect request."""
    view = inspect_container(layout, proc_root, request.pod, request.container)
    return InspectReply(node_name=node, pod=request.pod, container=request.container, found=view.found,
                        processes=view.processes, devices=view.devices, installed_version=installed, message=view.message)


def inspect_container(layout: HostLayout, proc_root: Path, pod: PodRef, container: str) -> ContainerView:
    """Every host process of the container: those carrying the POD_UID / CONTAINER_NAME the webhook
    injects, and their descendants that cleared their environment (`su -`, `env -i`)."""
    if not _POD_UID.match(pod.uid) or not _CONTAINER.match(container):
        return ContainerView(False, [], [], "pod uid and container name must be Kubernetes names")
    ours = _our_libraries(layout)
    reports: list[ProcessReport] = []
    cache_roots: list[tuple[Path, str]] = []
    for pid, env in _container_processes(proc_root, pod.uid, container):
        maps = procscan.mapped_files(proc_root, pid)
        if maps is None:
            continue  # exited while we looked: a normal answer, just not this process
        version = _mapped_version(maps, ours)
        root = proc_root / str(pid) / "root"
        reports.append(ProcessReport(
            pid=pid, preload=procscan.read_in_root(root, "/etc/ld.so.preload"),
            library_mapped=version is not None, library_version=version,
            memory_limit_env=env.get("CUDA_DEVICE_MEMORY_LIMIT"),
        ))
        if env.get("CUDA_DEVICE_MEMORY_SHARED_CACHE"):
            cache_roots.append((root, env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    cache_roots.append((layout.containers_dir, f"{pod.uid}_{container}/usage.cache"))
    devices, message = _first_usage(cache_roots)
    found = bool(reports)
    if not found:
        message = "no running process of this container on the node" + (f"; {message}" if message else "")
    return ContainerView(found, reports, devices, message)


def _container_processes(proc_root: Path, pod_uid: str, container: str) -> list[tuple[int, dict[str, str]]]:
    marked: dict[int, dict[str, str]] = {}
    unmarked: dict[int, dict[str, str]] = {}
    for pid in procscan.pids(proc_root):
        env = procscan.environ(proc_root, pid)
        if env is None:
            continue
        if env.get("POD_UID") == pod_uid and env.get("CONTAINER_NAME") == container:
            marked[pid] = env
        elif "POD_UID" not in env:
            unmarked[pid] = env
    # A descendant without the markers is the container's own process that dropped its
    # environment (`su -`, `env -i`, an SSH session): it belongs to the report, not outside it.
    cleared = {pid: env for pid, env in unmarked.items() if _descends_from(proc_root, pid, marked)}
    return sorted({**marked, **cleared}.items())


def _descends_from(proc_root: Path, pid: int, ancestors: dict[int, dict[str, str]]) -> bool:
    seen = set()
    current = procscan.parent(proc_root, pid)
    while current and current > 1 and current not in seen:
        if current in ancestors:
            return True
        seen.add(current)
        current = procscan.parent(proc_root, current)
    return False


def _our_libraries(layout: HostLayout) -> dict[tuple[tuple[int, int], int], str]:
    found = {}
    for version in installed_versions(layout):
        ident = procscan.identity(layout.library(version))
        if ident:
            found[ident] = version
    return found


def _mapped_version(maps: list[procscan.MappedFile], ours: dict[tuple[tuple[int, int], int], str]) -> str | None:
    for mapped in maps:
        name = os.path.basename(mapped.path)
        if (mapped.device, mapped.inode) in ours:
            return ours[(mapped.device, mapped.inode)]
        if name.startswith(LIBRARY_LINK):
            return version_from_name(name) or "unknown"
    return None


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
        return usage_cache.read_usage(f"/proc/self/fd/{fd}")


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
