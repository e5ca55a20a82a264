"""Install, upgrade, uninstall and garbage-collect libvgpu.so under a host root, crash-safely.

Invariant at every instant (and after a crash at any point): if `ld.so.preload` exists it
names `libvgpu.so`, which is a symlink to a complete, verified `libvgpu.so.<version>`.
Files are never rewritten in place: each is written under a temp name, fsynced, verified
and renamed, so a process that has a version mapped keeps its inode until it exits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, Field

from kai_isolator.shared.errors import IsolatorError

from . import procscan
from .layout import LIBRARY_LINK, PRELOAD_FILE, HostLayout, check_version, version_from_name, version_of, versioned_name

Checkpoint = Callable[[str], None]
"""Called with the name of each step just before it takes effect (logging, fault injection)."""

MAX_LIBRARY_BYTES = 256 << 20
_TEMP = re.compile(r"^\..*\.tmp-\d+$")
_STAGING_PREFIX = ".vgpu.staging-"
_GPU_DEVICE = re.compile(r"^nvidia\d+$")


class InstallError(IsolatorError):
    """The library cannot be installed, activated or removed as asked; nothing was lost."""


class InstallStatus(BaseModel):
    host_root: str
    install_dir: str
    installed: bool
    active_version: str | None = None
    installed_versions: list[str] = Field(default_factory=list)
    preload: str = Field(description="ok | missing | directory | foreign")
    gpu_count: int = 0
    problems: list[str] = Field(default_factory=list)


class UninstallResult(BaseModel):
    removed: list[str] = Field(default_factory=list)
    still_in_use: list[str] = Field(default_factory=list, description="versions kept because processes map or preload them")
    complete: bool


def _noop(step: str) -> None:
    del step


# --- library checks ------------------------------------------------------------------


def verify_library(data: bytes, source: str) -> str:
    """Reject anything that is not an ELF shared object; return its version."""
    if not data:
        raise InstallError(f"{source}: empty file")
    if len(data) > MAX_LIBRARY_BYTES:
        raise InstallError(f"{source}: {len(data)} bytes, larger than {MAX_LIBRARY_BYTES}")
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise InstallError(f"{source}: not an ELF file")
    byteorder = "little" if data[5] == 1 else "big"
    if int.from_bytes(data[16:18], byteorder) != 3:  # e_type ET_DYN
        raise InstallError(f"{source}: ELF file is not a shared object")
    return version_of(data)


def read_library(path: Path) -> tuple[bytes, str]:
    try:
        with open(path, "rb") as f:
            if not os.path.isfile(f"/proc/self/fd/{f.fileno()}"):
                raise InstallError(f"{path}: not a regular file")
            data = f.read(MAX_LIBRARY_BYTES + 1)
    except OSError as error:
        raise InstallError(f"cannot read library {path}: {error.strerror}") from None
    return data, verify_library(data, str(path))


# --- atomic file primitives ------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(final: str) -> str:
    return f".{final}.tmp-{os.getpid()}"


def _write_new(directory: Path, name: str, data: bytes, mode: int) -> Path:
    """Write `data` to a fresh temp file in `directory`, fsync it, read it back; return its path."""
    temp = directory / _temp_name(name)
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    if temp.read_bytes() != data:
        temp.unlink()
        raise InstallError(f"{temp}: read-back differs from what was written (disk or filesystem fault)")
    return temp


def _symlink_new(directory: Path, name: str, target: str) -> Path:
    temp = directory / _temp_name(name)
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    os.symlink(target, temp)
    return temp


# --- state ------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(layout: HostLayout) -> Iterator[None]:
    """One installer at a time per host root (the agent, an operator's one-shot, a test)."""
    layout.agent_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(layout.agent_dir / "install.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _retired_path(layout: HostLayout) -> Path:
    return layout.agent_dir / "retired.json"


def _load_retired(layout: HostLayout) -> dict[str, float]:
    try:
        raw = json.loads(_retired_path(layout).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: float(v) for k, v in raw.items() if isinstance(v, int | float) and version_from_name(f"{LIBRARY_LINK}.{k}")}


def _save_retired(layout: HostLayout, retired: dict[str, float]) -> None:
    temp = _write_new(layout.agent_dir, "retired.json", json.dumps(retired, sort_keys=True).encode(), 0o600)
    os.rename(temp, _retired_path(layout))


# --- reading the install directory -------------------------------------------------------


def active_version(layout: HostLayout) -> str | None:
    try:
        return version_from_name(os.readlink(layout.link))
    except OSError:
        return None


def installed_versions(layout: HostLayout) -> list[str]:
    try:
        names = os.listdir(layout.install_dir)
    except OSError:
        return []
    return sorted(v for v in map(version_from_name, names) if v)


def _preload_state(layout: HostLayout) -> str:
    try:
        st = os.lstat(layout.preload)
    except FileNotFoundError:
        return "missing"
    if os.path.isdir(layout.preload) and not os.path.islink(layout.preload):
        return "directory"
    try:
        ok = st.st_size < 4096 and layout.preload.read_text() == layout.preload_content
    except OSError:
        ok = False
    return "ok" if ok else "foreign"


def gpu_count(layout: HostLayout) -> int:
    try:
        return sum(1 for name in os.listdir(layout.host_root / "dev") if _GPU_DEVICE.match(name))
    except OSError:
        return 0


def status(layout: HostLayout) -> InstallStatus:
    """What is on disk now, and what is wrong with it."""
    active = active_version(layout)
    preload = _preload_state(layout)
    problems = []
    if preload == "directory":
        problems.append("ld.so.preload is a directory (kubelet created it for a missing subPath)")
    if preload == "foreign":
        problems.append(f"ld.so.preload does not contain {layout.preload_content.strip()!r}")
    if os.path.lexists(layout.link) and active is None:
        problems.append("libvgpu.so is not a link to a versioned library")
    if active is not None:
        try:
            if version_of(layout.library(active).read_bytes()) != active:
                problems.append(f"libvgpu.so.{active} does not match its content address")
        except OSError:
            problems.append(f"libvgpu.so points at missing libvgpu.so.{active}")
    if preload == "ok" and active is None:
        problems.append("ld.so.preload names a library that is not installed")
    return InstallStatus(
        host_root=str(layout.host_root), install_dir=str(layout.install_dir),
        installed=preload == "ok" and active is not None and not problems,
        active_version=active, installed_versions=installed_versions(layout), preload=preload,
        gpu_count=gpu_count(layout), problems=problems,
    )


# --- install / activate -------------------------------------------------------------------


def install(layout: HostLayout, library: Path, checkpoint: Checkpoint = _noop) -> str:
    """Install the library file and make it the active version; returns the version."""
    data, version = read_library(library)
    with locked(layout):
        _activate(layout, data, version, checkpoint)
    return version


def activate(layout: HostLayout, version: str, carried: dict[str, Path], checkpoint: Checkpoint = _noop) -> str:
    """Make `version` active: from the install directory if present and intact, else from a carried file."""
    check_version(version)
    with locked(layout):
        data = _intact_copy(layout.library(version), version)
        if data is None and version in carried:
            data, found = read_library(carried[version])
            if found != version:
                raise InstallError(f"carried file {carried[version]} is version {found}, not {version}")
        if data is None:
            raise InstallError(f"version {version} is neither installed nor carried by this agent")
        _activate(layout, data, version, checkpoint)
    return version


def _intact_copy(path: Path, version: str) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if version_of(data) == version else None


def _activate(layout: HostLayout, data: bytes, version: str, checkpoint: Checkpoint) -> None:
    _clean_leftovers(layout)
    if _first_install(layout, data, version, checkpoint):
        return
    previous = active_version(layout)
    _repair_preload_dir(layout, checkpoint)
    directory = layout.install_dir
    if _intact_copy(layout.library(version), version) is None:
        checkpoint("write-library")
        temp = _write_new(directory, versioned_name(version), data, 0o644)
        checkpoint("rename-library")
        os.rename(temp, layout.library(version))
        _fsync_dir(directory)
    if previous != version:
        checkpoint("write-link")
        temp = _symlink_new(directory, LIBRARY_LINK, versioned_name(version))
        checkpoint("rename-link")
        os.rename(temp, layout.link)
        _fsync_dir(directory)
    if _preload_state(layout) != "ok":
        checkpoint("write-preload")
        temp = _write_new(directory, PRELOAD_FILE, layout.preload_content.encode(), 0o644)
        checkpoint("rename-preload")
        os.rename(temp, layout.preload)
        _fsync_dir(directory)
    if previous and previous != version:
        retired = _load_retired(layout)
        retired[previous] = time.time()
        retired.pop(version, None)
        _save_retired(layout, retired)
    checkpoint("done")


def _first_install(layout: HostLayout, data: bytes, version: str, checkpoint: Checkpoint) -> bool:
    """Build the whole directory beside its final place and rename it in, so it appears complete."""
    target = layout.install_dir
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f"{_STAGING_PREFIX}{os.getpid()}"
    _remove_tree(staging)
    try:
        staging.mkdir(mode=0o755)
    except OSError as error:
        # In the DaemonSet the directory is the agent's hostPath mount, in a read-only root: nothing can be staged
        # beside it. The file-by-file path keeps the invariant (the preload file comes last).
        if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return False
        raise
    checkpoint("stage-directory")
    os.rename(_write_new(staging, versioned_name(version), data, 0o644), staging / versioned_name(version))
    os.symlink(versioned_name(version), staging / LIBRARY_LINK)
    os.rename(_write_new(staging, PRELOAD_FILE, layout.preload_content.encode(), 0o644), staging / PRELOAD_FILE)
    os.chmod(staging, 0o755)
    _fsync_dir(staging)
    checkpoint("rename-directory")
    try:
        os.rename(staging, target)  # replaces an empty directory atomically too
    except OSError as error:
        if error.errno != errno.EBUSY:
            raise
        _remove_tree(staging)  # an empty mount point (a hostPath) cannot be replaced: install into it instead
        return False
    _fsync_dir(target.parent)
    checkpoint("done")
    return True


def _repair_preload_dir(layout: HostLayout, checkpoint: Checkpoint) -> None:
    """kubelet creates a directory for a subPath that does not exist yet; move it out of the way."""
    if _preload_state(layout) != "directory":
        return
    checkpoint("repair-preload-directory")
    aside = layout.install_dir / f".{PRELOAD_FILE}.kubelet-{os.getpid()}-{time.time_ns()}"
    os.rename(layout.preload, aside)
    with contextlib.suppress(OSError):
        aside.rmdir()  # a non-empty one is kept for the operator to look at


def _clean_leftovers(layout: HostLayout) -> None:
    """Temp files and staging directories of an installer that died (we hold the lock, so none is live)."""
    parent = layout.install_dir.parent
    if parent.is_dir():
        for entry in parent.iterdir():
            if entry.name.startswith(_STAGING_PREFIX):
                _remove_tree(entry)
    if layout.install_dir.is_dir():
        for entry in layout.install_dir.iterdir():
            if _TEMP.match(entry.name):
                entry.unlink()


def _remove_tree(path: Path) -> None:
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink():
        for entry in path.iterdir():
            _remove_tree(entry)
        path.rmdir()
    else:
        path.unlink()


# --- who uses what ------------------------------------------------------------------------


def versions_in_use(layout: HostLayout, proc_root: Path, *, through_preload: bool = False) -> set[str]:
    """Versions some process maps (and, if asked, versions some process's /etc/ld.so.preload reaches)."""
    ours = {procscan.identity(layout.library(v)): v for v in installed_versions(layout)}
    ours.pop(None, None)
    by_inode = {ident[1]: v for ident, v in ours.items() if ident}
    used: set[str] = set()
    for pid in procscan.pids(proc_root):
        for mapped in procscan.mapped_files(proc_root, pid) or []:
            version = ours.get((mapped.device, mapped.inode))
            if version is None and os.path.basename(mapped.path).startswith(LIBRARY_LINK):
                version = by_inode.get(mapped.inode)  # overlay filesystems report another device
            if version:
                used.add(version)
        if through_preload:
            used |= _preloaded_versions(proc_root / str(pid) / "root", ours)
    return used


def _preloaded_versions(root: Path, ours: dict[tuple[tuple[int, int], int] | None, str]) -> set[str]:
    content = procscan.read_in_root(root, "/etc/ld.so.preload")
    found: set[str] = set()
    for entry in (content or "").replace(":", " ").split():
        try:
            with procscan.open_in_root(root, entry) as fd:
                st = os.fstat(fd)
        except OSError:
            continue
        version = ours.get(((os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino))
        if version:
            found.add(version)
    return found


def collect_garbage(layout: HostLayout, proc_root: Path, grace_s: float) -> tuple[list[str], list[str]]:
    """Remove inactive versions no process maps, once retired for `grace_s`; returns (removed, kept)."""
    removed: list[str] = []
    kept: list[str] = []
    with locked(layout):
        active = active_version(layout)
        candidates = [v for v in installed_versions(layout) if v != active]
        if not candidates:
            return removed, kept
        retired = _load_retired(layout)
        now = time.time()
        for version in candidates:
            retired.setdefault(version, now)  # found without a record (e.g. after a crash): start its grace now
        in_use = versions_in_use(layout, proc_root)
        for version in candidates:
            if version in in_use or now - retired[version] < grace_s:
                kept.append(version)
                continue
            layout.library(version).unlink()
            retired.pop(version)
            removed.append(version)
        if removed:
            _fsync_dir(layout.install_dir)
        _save_retired(layout, retired)
    return removed, kept


def uninstall(layout: HostLayout, proc_root: Path, checkpoint: Checkpoint = _noop) -> UninstallResult:
    """Stop new processes from preloading first, then remove what no process maps or preloads."""
    with locked(layout):
        if not layout.install_dir.exists():
            return UninstallResult(complete=True)
        _clean_leftovers(layout)
        if os.path.lexists(layout.preload):
            checkpoint("remove-preload")
            if _preload_state(layout) == "directory":
                _repair_preload_dir(layout, checkpoint)
            else:
                layout.preload.unlink()
            _fsync_dir(layout.install_dir)
        in_use = versions_in_use(layout, proc_root, through_preload=True)
        active = active_version(layout)
        removed = []
        if active and active in in_use:
            pass  # running containers' /etc/ld.so.preload still names libvgpu.so: keep the link
        elif os.path.lexists(layout.link):
            checkpoint("remove-link")
            layout.link.unlink()
        for version in installed_versions(layout):
            if version in in_use:
                continue
            checkpoint("remove-library")
            layout.library(version).unlink()
            removed.append(version)
        _fsync_dir(layout.install_dir)
        complete = not in_use
        if complete:
            with contextlib.suppress(OSError):
                _retired_path(layout).unlink()
            try:
                layout.install_dir.rmdir()
            except OSError as error:
                if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        return UninstallResult(removed=removed, still_in_use=sorted(in_use), complete=complete)
