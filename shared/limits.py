"""CUDA_DEVICE_MEMORY_LIMIT values, parsed exactly as libvgpu.so parses them (hami-core/README.md)."""

from __future__ import annotations

import re

from .errors import ConfigError

_LIMIT = re.compile(r"^\s*(\d+)\s*(?:([kmgt])(i)?(b)?)?\s*$", re.IGNORECASE)
_SHIFT = {"k": 10, "m": 20, "g": 30, "t": 40}


def parse_limit(value: str) -> int:
    """Bytes for `4147m`, `4Gi`, `4GiB`, `1073741824`; 0 means no limit. ConfigError for anything else."""
    match = _LIMIT.match(value)
    if not match:
        raise ConfigError(f"not a memory limit: {value!r} (expected bytes or a k/m/g/t suffix, e.g. 4147m)")
    number, unit = int(match.group(1)), (match.group(2) or "").lower()
    return number << _SHIFT[unit] if unit else number


def format_mib(size: int) -> str:
    return f"{size >> 20}MiB"
