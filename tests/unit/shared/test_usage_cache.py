"""The usage-cache reader: validation of magic, version and size, typed results, and
retry/failure on torn reads. Files are built here byte by byte from the documented layout."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from kai_isolator.shared import usage_cache as uc


def build_file(magic: int = uc.MAGIC, version: int = uc.VERSION, seq: int = 2) -> bytearray:
    data = bytearray(uc.FILE_SIZE)
    struct.pack_into("<IIQIIQQ", data, 0, magic, version, uc.FILE_SIZE, uc.DEVICES, uc.SLOTS, seq, 123456789)
    dev = uc._HEADER.size
    struct.pack_into("<QQQ8x96s", data, dev, 4147 << 20, 300, 123456000, b"GPU-abc")
    struct.pack_into("<QQQ8x96s", data, dev + 128, uc.NO_LIMIT, 0, 123456999, b"")
    slot = uc._HEADER.size + uc.DEVICES * 128 + 5 * 192
    struct.pack_into("<iIQ", data, slot, 4242, 0, 99)
    struct.pack_into("<Q", data, slot + 16, 300)
    return data


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "usage.cache"
    path.write_bytes(bytes(data))
    return path


def test_reads_devices_and_processes(tmp_path: Path) -> None:
    snap = uc.read_usage(write(tmp_path, build_file()))
    assert snap.version == 3 and snap.last_update_ns == 123456999  # the newest of header and devices
    assert snap.devices[0] == uc.DeviceUsage(index=0, uuid="GPU-abc", limit_bytes=4147 << 20, used_bytes=300,
                                             last_update_ns=123456000)
    assert snap.devices[1].limit_bytes is None
    assert snap.processes == [uc.ProcessUsage(pid=4242, used_bytes={0: 300})]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (build_file(magic=0x19920718), "bad magic"),
        (build_file(version=1), "version 1"),
        (build_file()[:1000], "truncated"),
        (build_file() + b"\0", "size"),
    ],
)
def test_bad_files_are_typed_errors(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(uc.UsageCacheError, match=message):
        uc.read_usage(write(tmp_path, data))


def test_missing_file_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(uc.UsageCacheError):
        uc.read_usage(tmp_path / "absent.cache")


def test_a_write_in_progress_is_never_returned(tmp_path: Path) -> None:
    with pytest.raises(uc.TornReadError):
        uc.read_usage(write(tmp_path, build_file(seq=3)), attempts=3)


def test_errors_name_the_file_as_shown_not_the_descriptor_it_was_read_through(tmp_path: Path) -> None:
    # The node agent reads through /proc/self/fd/N and confirms a finding by a second read: the
    # message must be the same both times, whatever descriptor each read got.
    path = write(tmp_path, build_file()[:1000])
    held: list[int] = []
    messages = set()
    for _ in range(2):
        held.append(os.open(path, os.O_RDONLY))  # each read goes through a new descriptor number
        with pytest.raises(uc.UsageCacheError) as error:
            uc.read_usage(f"/proc/self/fd/{held[-1]}", shown_as="pod_c/usage.cache")
        messages.add(str(error.value))
    for fd in held:
        os.close(fd)
    assert messages == {f"pod_c/usage.cache: size 1000, expected {uc.FILE_SIZE} (truncated or foreign)"}
