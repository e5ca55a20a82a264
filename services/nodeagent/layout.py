"""Where the node agent's files live on the host, and the names it gives them.

Everything is under `--host-root` (the host's `/` mounted into the agent's container), so
tests run the same code against a temp directory.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from kai_isolator.shared.contract import DEFAULT_VGPU_MOUNT
from kai_isolator.shared.errors import ConfigError

LIBRARY_LINK = "libvgpu.so"
PRELOAD_FILE = "ld.so.preload"
VERSION_LENGTH = 16  # hex digits of sha256: enough to never collide between builds
_VERSIONED = re.compile(r"^libvgpu\.so\.([0-9a-f]{%d})$" % VERSION_LENGTH)
_VERSION = re.compile(r"^[0-9a-f]{%d}$" % VERSION_LENGTH)
DEFAULT_MOUNT = DEFAULT_VGPU_MOUNT
STATE_DIR = "var/lib/kai-isolator"


def version_of(data: bytes) -> str:
    """The content address of a library build."""
    return hashlib.sha256(data).hexdigest()[:VERSION_LENGTH]


def versioned_name(version: str) -> str:
    check_version(version)
    return f"{LIBRARY_LINK}.{version}"


def version_from_name(name: str) -> str | None:
    match = _VERSIONED.match(name)
    return match.group(1) if match else None


def check_version(version: str) -> str:
    if not _VERSION.match(version):
        raise ConfigError(f"library version must be {VERSION_LENGTH} lowercase hex digits (a sha256 prefix), got {version!r}")
    return version


def check_mount(mount: str) -> str:
    """The in-container directory of the library: absolute, normalised, safe to write into ld.so.preload."""
    if not mount.startswith("/") or posixpath.normpath(mount) != mount or mount == "/":
        raise ConfigError(f"--container-vgpu-mount must be a normalised absolute directory, got {mount!r}")
    if any(c.isspace() or c in ":\0" for c in mount):
        raise ConfigError(f"--container-vgpu-mount must not contain spaces, ':' or control characters: {mount!r}")
    return mount


@dataclass(frozen=True)
class HostLayout:
    """The host paths of one node: the library directory and the agent's state directory."""

    host_root: Path
    mount: str = DEFAULT_MOUNT

    def __post_init__(self) -> None:
        check_mount(self.mount)
        if not self.host_root.is_dir():
            raise ConfigError(f"--host-root {self.host_root} is not a directory")

    @property
    def install_dir(self) -> Path:
        return self.host_root / self.mount.lstrip("/")

    @property
    def link(self) -> Path:
        return self.install_dir / LIBRARY_LINK

    @property
    def preload(self) -> Path:
        return self.install_dir / PRELOAD_FILE

    @property
    def preload_content(self) -> str:
        return f"{self.mount}/{LIBRARY_LINK}\n"

    @property
    def state_dir(self) -> Path:
        return self.host_root / STATE_DIR

    @property
    def containers_dir(self) -> Path:
        """Per-container writable state (`<pod uid>_<container>/usage.cache`), apart from the library."""
        return self.state_dir / "containers"

    @property
    def agent_dir(self) -> Path:
        return self.state_dir / "agent"

    def library(self, version: str) -> Path:
        return self.install_dir / versioned_name(version)
