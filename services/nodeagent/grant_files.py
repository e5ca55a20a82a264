"""The grant files on the node: written atomically, root-owned and read-only (0444 in a 0755 directory) where the
webhook mounts them, never through a link planted in the tree; found, removed and collected when pods go."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from kai_isolator.shared.contract import GRANT_FILE
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.grant import Grant, grant_dir_name

# What may become one path component of the grant dir: a pod uid and a DNS-label container name.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,252}$")
_TEMP_PREFIX = ".grant.json."


def same_grant(a: Grant, b: Grant) -> bool:
    """Equal but for when they were written."""
    return a.model_dump(exclude={"written_at"}) == b.model_dump(exclude={"written_at"})


def _component(value: str, what: str) -> str:
    if not _NAME.match(value) or value in (".", ".."):
        raise ConfigError(f"{what} {value!r} cannot name a grant directory")
    return value


def grant_path(root: Path, pod_uid: str, container: str) -> Path:
    return root / grant_dir_name(_component(pod_uid, "pod uid"), _component(container, "container name")) / GRANT_FILE


def read_grant(root: Path, pod_uid: str, container: str) -> Grant | None:
    """The grant written earlier, or None when there is none or it is unreadable (it is then rewritten)."""
    try:
        return Grant.model_validate_json(grant_path(root, pod_uid, container).read_bytes())
    except (OSError, ValidationError, ValueError):
        return None


@contextlib.contextmanager
def _open_dir(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def write_grant(root: Path, grant: Grant) -> bool:
    """Atomically (re)write the grant, mode 0444, in its 0755 directory; False when it already says this."""
    path = grant_path(root, grant.pod_uid, grant.container)
    existing = read_grant(root, grant.pod_uid, grant.container)
    if existing is not None and same_grant(existing, grant) and (path.stat().st_mode & 0o777) == 0o444:
        return False
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path.parent, 0o755)  # the kubelet may have made it first (subPathExpr)
    data = grant.model_dump_json().encode()
    temp = f"{_TEMP_PREFIX}{os.getpid()}.{time.monotonic_ns()}"
    # Through a directory fd opened without following links: a link planted in the tree is never written through.
    with _open_dir(path.parent) as directory:
        os.fchmod(directory, 0o755)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444, dir_fd=directory)
        try:
            os.fchmod(fd, 0o444)
            os.write(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(temp, dir_fd=directory)
            raise
        os.close(fd)
        os.replace(temp, GRANT_FILE, src_dir_fd=directory, dst_dir_fd=directory)
        os.fsync(directory)
    return True


def granted_pods(root: Path) -> dict[str, list[Path]]:
    """Pod uid -> its grant directories found on the host."""
    found: dict[str, list[Path]] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            uid, sep, _ = entry.name.partition("_")
            if sep and entry.is_dir(follow_symlinks=False):
                found.setdefault(uid, []).append(Path(entry.path))
    return found


def remove_grants(root: Path, pod_uid: str) -> list[str]:
    """Remove every grant directory of a pod; the container names whose grants were removed."""
    removed = []
    for directory in granted_pods(root).get(pod_uid, []):
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory.name.partition("_")[2])
    return removed


def collect_stale(root: Path, live: set[str], grace_s: float) -> list[str]:
    """Remove grant directories of pods no longer on this node, once untouched for `grace_s` (a pod bound
    after the listing may have had its directory made by the kubelet meanwhile)."""
    removed = []
    now = time.time()
    for uid, directories in granted_pods(root).items():
        if uid in live:
            continue
        for directory in directories:
            with contextlib.suppress(FileNotFoundError):
                if now - directory.stat().st_mtime >= grace_s:
                    shutil.rmtree(directory, ignore_errors=True)
                    removed.append(directory.name)
    return removed
