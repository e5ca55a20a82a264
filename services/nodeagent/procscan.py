"""Read what processes on the host really have: mapped files, environment, and files seen
through their own root, without ever following a tenant's symlink out of its container."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_SMALL_FILE = 4096
MAX_ENVIRON = 1 << 20
MAX_LINKS = 40


Identity = tuple[tuple[int, int], int]  # ((major, minor), inode), as /proc/<pid>/maps spells a file


@dataclass(frozen=True)
class MappedFile:
    path: str  # as the process sees it, without the " (deleted)" suffix
    device: tuple[int, int]
    inode: int
    deleted: bool


def pids(proc_root: Path) -> list[int]:
    try:
        return sorted(int(entry) for entry in os.listdir(proc_root) if entry.isdigit())
    except OSError:
        return []


def mapped_files(proc_root: Path, pid: int) -> list[MappedFile] | None:
    """Distinct files mapped by a process; None when it is gone or unreadable."""
    try:
        with open(proc_root / str(pid) / "maps", "rb") as maps:
            data = maps.read()
    except OSError:
        return None
    seen: dict[tuple[tuple[int, int], int], MappedFile] = {}
    for raw in data.splitlines():
        fields = raw.decode(errors="replace").split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        major, _, minor = fields[3].partition(":")
        try:
            device, inode = (int(major, 16), int(minor, 16)), int(fields[4])
        except ValueError:
            continue
        path, deleted = fields[5], fields[5].endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        seen.setdefault((device, inode), MappedFile(path, device, inode, deleted))
    return list(seen.values())


def environ(proc_root: Path, pid: int) -> dict[str, str] | None:
    try:
        with open(proc_root / str(pid) / "environ", "rb") as env:
            data = env.read(MAX_ENVIRON)
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in data.split(b"\0") if item)
    return {key: value for key, sep, value in pairs if sep}


def mount_roots(proc_root: Path, pid: int) -> dict[str, str] | None:
    """Mount point -> root of that mount within its filesystem, from /proc/<pid>/mountinfo
    (the kubelet's subPath shows there as the root); None when the process is gone."""
    try:
        with open(proc_root / str(pid) / "mountinfo", "rb") as info:
            data = info.read()
    except OSError:
        return None
    found = {}
    for raw in data.splitlines():
        fields = raw.decode(errors="replace").split()
        if len(fields) > 4:
            found[_unescape(fields[4])] = _unescape(fields[3])
    return found


def file_locks(proc_root: Path, pid: int) -> list[tuple[tuple[int, int], int, int, int]]:
    """Write locks the process's open files hold: (device, inode, first byte, last byte), from fdinfo."""
    base = proc_root / str(pid) / "fdinfo"
    try:
        fds = os.listdir(base)
    except OSError:
        return []
    locks = []
    for fd in fds:
        try:
            with open(base / fd, "rb") as info:
                data = info.read(MAX_SMALL_FILE)
        except OSError:
            continue
        for raw in data.splitlines():
            # lock:	1: OFDLCK ADVISORY  WRITE -1 fe:00:10051812 2112 2303
            fields = raw.decode(errors="replace").split()
            if len(fields) < 9 or fields[0] != "lock:" or fields[4] != "WRITE":
                continue
            major, minor, inode = fields[6].split(":") if fields[6].count(":") == 2 else ("", "", "")
            with contextlib.suppress(ValueError):
                locks.append(((int(major, 16), int(minor, 16)), int(inode), int(fields[7]),
                              -1 if fields[8] == "EOF" else int(fields[8])))
    return locks


def namespaced_pid(proc_root: Path, pid: int) -> int | None:
    """The pid the process has in its own (innermost) PID namespace, as it writes it into files."""
    try:
        with open(proc_root / str(pid) / "status", "rb") as status_file:
            for raw in status_file.read().splitlines():
                if raw.startswith(b"NSpid:"):
                    return int(raw.split()[-1])
    except (OSError, ValueError):
        return None
    return pid


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def identity(path: Path) -> Identity | None:
    """(device, inode) of a file as /proc/<pid>/maps spells it; None if it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino


@contextlib.contextmanager
def open_in_root(root: Path, path: str, *, final_link_ok: bool = True) -> Iterator[int]:
    """Open the regular file `path` for reading as a process whose `/` is `root` would.

    Symlinks are resolved by hand inside `root` (absolute ones restart at `root`, `..`
    stops at it), so a tenant's link to a host file reaches nothing outside its container.
    FIFOs, devices and directories are refused, and nothing blocks.
    """
    with _walk_in_root(root, path, os.O_RDONLY | os.O_NONBLOCK, final_link_ok=final_link_ok) as fd:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        yield fd


def identity_in_root(root: Path, path: str) -> Identity | None:
    """(device, inode) of what `path` is for a process whose `/` is `root` (file or directory,
    symlinks resolved inside `root`); None when it does not exist there or cannot be reached."""
    try:
        with _walk_in_root(root, path, os.O_PATH) as fd:
            st = os.fstat(fd)
    except OSError:
        return None
    return (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino


@contextlib.contextmanager
def _walk_in_root(root: Path, path: str, final_flags: int, *, final_link_ok: bool = True) -> Iterator[int]:
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    stack: list[int] = []
    fd = -1
    try:
        parts = _components(path)
        links = 0
        while parts:
            name = parts.pop(0)
            here = stack[-1] if stack else root_fd
            if name == "..":
                if stack:
                    os.close(stack.pop())
                continue
            target = _readlink(name, here)
            if target is not None:
                links += 1
                if links > MAX_LINKS or (not parts and not final_link_ok):
                    raise OSError(errno.ELOOP, "too many or forbidden symbolic links", path)
                if target.startswith("/"):
                    while stack:
                        os.close(stack.pop())
                parts = _components(target) + parts
                continue
            if parts:
                stack.append(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here))
            else:
                fd = os.open(name, final_flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
        if fd < 0:
            raise OSError(errno.EISDIR, "not a file", path)
        yield fd
    finally:
        for handle in [*stack, root_fd] + ([fd] if fd >= 0 else []):
            os.close(handle)


def read_in_root(root: Path, path: str, limit: int = MAX_SMALL_FILE) -> str | None:
    """A small text file as seen from `root`; None if it is absent, unreadable or not a regular file."""
    try:
        with open_in_root(root, path) as fd:
            return os.read(fd, limit).decode(errors="replace")
    except OSError:
        return None


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _readlink(name: str, dir_fd: int) -> str | None:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return None
        raise
