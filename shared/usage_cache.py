"""Reader for libvgpu.so's shared accounting file (CUDA_DEVICE_MEMORY_SHARED_CACHE):
maps it read-only, validates it, and returns typed per-device and per-process usage.
The byte layout is hami-core/src/shm_layout.h (format version 3)."""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

from pydantic import BaseModel

from kai_isolator.shared.errors import IsolatorError

MAGIC = 0x55504756
VERSION = 3
DEVICES = 16
SLOTS = 1024
NO_LIMIT = (1 << 64) - 1
_HEADER = struct.Struct("<IIQIIQQ24x")  # 64 bytes
_DEVICE = struct.Struct("<QQQ8x96s")  # 128 bytes
_SLOT = struct.Struct("<iIQ16Q48x")  # 192 bytes
FILE_SIZE = _HEADER.size + DEVICES * _DEVICE.size + SLOTS * _SLOT.size
_SEQ_OFFSET = 24


class UsageCacheError(IsolatorError):
    """The file is missing, truncated, foreign or of another format version."""


class TornReadError(UsageCacheError):
    """Writers kept changing the file while it was read."""


class DeviceUsage(BaseModel):
    index: int
    uuid: str
    limit_bytes: int | None  # None: unlimited; 0: closed (the library refuses allocations)
    used_bytes: int
    last_update_ns: int = 0  # wall clock of the last change to used_bytes (coarse, ~4 ms)


class ProcessUsage(BaseModel):
    pid: int
    used_bytes: dict[int, int]  # device index -> bytes, devices with usage only


class UsageSnapshot(BaseModel):
    """Device totals are authoritative. Reserve/release update them and the per-process
    numbers with separate atomic writes, so while processes allocate the per-process sum
    may differ from a total by operations in flight; a dead process's usage stays until a
    process of the container reclaims it (at its next allocation that does not fit, usage
    query or start)."""

    version: int
    last_update_ns: int  # latest of the header's and the devices' timestamps
    devices: list[DeviceUsage]
    processes: list[ProcessUsage]


def _decode(data: bytes) -> UsageSnapshot:
    magic, version, size, ndev, nslots, _seq, last_update = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise UsageCacheError(f"bad magic {magic:#x}: not a libvgpu accounting file")
    if version != VERSION:
        raise UsageCacheError(f"unsupported format version {version} (reader knows {VERSION})")
    if (size, ndev, nslots) != (FILE_SIZE, DEVICES, SLOTS):
        raise UsageCacheError(f"inconsistent header: size={size} devices={ndev} slots={nslots}")
    devices = []
    for i in range(DEVICES):
        limit, used, updated, uuid = _DEVICE.unpack_from(data, _HEADER.size + i * _DEVICE.size)
        devices.append(DeviceUsage(index=i, uuid=uuid.split(b"\0", 1)[0].decode(errors="replace"),
                                   limit_bytes=None if limit == NO_LIMIT else limit, used_bytes=used,
                                   last_update_ns=updated))
    processes = []
    base = _HEADER.size + DEVICES * _DEVICE.size
    for s in range(SLOTS):
        pid, _reserved, _start, *used = _SLOT.unpack_from(data, base + s * _SLOT.size)
        if pid:
            processes.append(ProcessUsage(pid=pid, used_bytes={d: u for d, u in enumerate(used) if u}))
    last_update = max([last_update] + [d.last_update_ns for d in devices])
    return UsageSnapshot(version=version, last_update_ns=last_update, devices=devices, processes=processes)


def read_usage(path: str | os.PathLike[str], attempts: int = 100, shown_as: str | None = None) -> UsageSnapshot:
    """Consistent snapshot of the file; a read that overlaps a write is retried. Errors name
    the file `shown_as` when given (a /proc/self/fd path says nothing, and changes between reads)."""
    name = shown_as or str(path)
    try:
        with open(Path(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != FILE_SIZE:
                raise UsageCacheError(f"{name}: size {size}, expected {FILE_SIZE} (truncated or foreign)")
            with mmap.mmap(f.fileno(), FILE_SIZE, access=mmap.ACCESS_READ) as view:
                for _ in range(attempts):
                    before = struct.unpack_from("<Q", view, _SEQ_OFFSET)[0]
                    data = view[:FILE_SIZE]
                    after = struct.unpack_from("<Q", view, _SEQ_OFFSET)[0]
                    if before == after and before % 2 == 0:
                        return _decode(data)
                    time.sleep(0.0005)
    except OSError as exc:
        raise UsageCacheError(f"{name}: {exc.strerror}") from exc
    raise TornReadError(f"{name}: still changing after {attempts} attempts")
