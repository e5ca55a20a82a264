"""CUDA_DEVICE_MEMORY_LIMIT[_i] parsing and per-device limits, observed through
cuDeviceTotalMem_v2 / cuMemGetInfo_v2 and real allocations on the fake driver."""

from __future__ import annotations

import pytest

from vgpu_harness import MIB, probe

PHYSICAL = 15360 * MIB
GIB = 1 << 30


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("4147m", 4147 * MIB),
        ("4g", 4 * GIB),
        ("4G", 4 * GIB),
        ("4Gi", 4 * GIB),
        ("4GiB", 4 * GIB),
        ("4gb", 4 * GIB),
        ("4096m", 4096 * MIB),
        ("4194304k", 4 * GIB),
        ("  4g  ", 4 * GIB),
        ("1073741824", GIB),
        ("08g", 8 * GIB),
        ("1t", 1 << 40),
        ("0", None),
        ("0m", None),
        ("", None),
    ],
)
def test_valid_limit_formats(value: str, expected: int | None) -> None:
    result = probe("totalmem", "0", "info", env={"CUDA_DEVICE_MEMORY_LIMIT": value})
    want = PHYSICAL if expected is None else min(expected, PHYSICAL)
    assert int(result.fields("totalmem")["bytes"]) == want
    assert int(result.fields("info")["total"]) == want
    assert result.stderr == ""


@pytest.mark.parametrize("value", ["4.5g", "-1", "abc", "4x", "4 g", "0x10", "g", "4gg", "4ib", "4g5", "99999999999999999999"])
def test_malformed_limit_fails_closed_with_one_error_line(value: str) -> None:
    result = probe("alloc", "1", "info", "fake", "0", env={"CUDA_DEVICE_MEMORY_LIMIT": value})
    errors = result.stderr.splitlines()
    assert len(errors) == 1, result.stderr
    assert "CUDA_DEVICE_MEMORY_LIMIT" in errors[0] and value in errors[0] and "ERROR" in errors[0]
    assert result.rcs("alloc") == [2]  # CUDA_ERROR_OUT_OF_MEMORY, not unlimited
    assert int(result.fields("fake")["allocs"]) == 0
    assert result.fields("info")["total"] == "0"


def test_per_device_limit_wins_and_others_use_the_fallback() -> None:
    env = {"FAKE_CUDA_DEVICES": "2", "CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_LIMIT_1": "2g"}
    result = probe("totalmem", "0", "totalmem", "1", "alloc", str(GIB + 1),
                   "ctx", "1", "alloc", str(GIB + 1), "fake", "0", "fake", "1", env=env)
    assert [int(f["bytes"]) for f in result.all_fields("totalmem")] == [GIB, 2 * GIB]
    assert result.rcs("alloc") == [2, 0]
    assert int(result.fields("fake", 0)["used"]) == 0
    assert int(result.fields("fake", 1)["used"]) == GIB + 1


def test_bad_per_device_value_only_closes_that_device() -> None:
    env = {"FAKE_CUDA_DEVICES": "2", "CUDA_DEVICE_MEMORY_LIMIT_1": "lots"}
    result = probe("alloc", str(GIB), "ctx", "1", "alloc", "1", env=env)
    assert result.rcs("alloc") == [0, 2]
    assert len(result.stderr.splitlines()) == 1 and "CUDA_DEVICE_MEMORY_LIMIT_1" in result.stderr


def test_per_device_zero_falls_back_to_the_global_limit() -> None:
    result = probe("totalmem", "0", env={"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_LIMIT_0": "0"})
    assert int(result.fields("totalmem")["bytes"]) == GIB


def test_cuda_visible_devices_maps_ordinals_to_device_indices() -> None:
    env = {"FAKE_CUDA_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_MEMORY_LIMIT_1": "1g"}
    result = probe("totalmem", "0", "alloc", str(GIB), "alloc", "1", "fake", "1", env=env)
    assert int(result.fields("totalmem")["bytes"]) == GIB
    assert result.rcs("alloc") == [0, 2]
    assert int(result.fields("fake")["used"]) == GIB


def fake_uuid(index: int) -> str:
    return f"GPU-{index:02d}00fa4e-1111-2222-3333-{index:012d}"  # what the fake NVML reports


def test_cuda_visible_devices_uuids_map_through_nvml() -> None:
    env = {"FAKE_CUDA_DEVICES": "3", "CUDA_VISIBLE_DEVICES": f"{fake_uuid(2)},{fake_uuid(0)[:7]}",
           "CUDA_DEVICE_MEMORY_LIMIT_2": "1m", "CUDA_DEVICE_MEMORY_LIMIT_0": "2m"}
    result = probe("totalmem", "0", "totalmem", "1", "alloc", str(MIB + 1), "alloc", str(MIB),
                   "ctx", "1", "alloc", str(2 * MIB), "fake", "2", "fake", "0", env=env)
    assert [int(f["bytes"]) for f in result.all_fields("totalmem")] == [MIB, 2 * MIB]
    assert result.rcs("alloc") == [2, 0, 0]  # ordinal 0 is GPU 2 (1 MiB), ordinal 1 is GPU 0 (2 MiB, abbreviated)
    assert [int(f["used"]) for f in result.all_fields("fake")] == [MIB, 2 * MIB]
    assert result.stderr == ""


def test_an_unknown_uuid_falls_back_to_ordinals_with_a_warning() -> None:
    env = {"FAKE_CUDA_DEVICES": "2", "CUDA_VISIBLE_DEVICES": f"{fake_uuid(1)},GPU-ffff",
           "CUDA_DEVICE_MEMORY_LIMIT_0": "1m", "CUDA_DEVICE_MEMORY_LIMIT_1": "8m"}
    result = probe("alloc", str(2 * MIB), env=env)
    assert result.rcs("alloc") == [2]  # ordinal 0 accounted as device 0, never unlimited
    assert len(result.stderr.splitlines()) == 1 and "GPU-ffff" in result.stderr


def test_bad_log_level_is_reported_once_and_changes_nothing_else() -> None:
    result = probe("alloc", "100", env={"LIBCUDA_LOG_LEVEL": "loud", "CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert result.rcs("alloc") == [0]
    assert len(result.stderr.splitlines()) == 1 and "LIBCUDA_LOG_LEVEL" in result.stderr


def test_info_log_level_explains_an_oom() -> None:
    result = probe("alloc", "2000000", env={"LIBCUDA_LOG_LEVEL": "3", "CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert result.rcs("alloc") == [2]
    assert "exceeds the limit of 1048576" in result.stderr


@pytest.mark.parametrize("path", ["link", "dlsym"])
def test_the_32_bit_info_calls_report_the_grant_too(path: str) -> None:
    info = probe("info1", env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, path=path).fields("info1")
    assert info["rc"] == "0,0" and int(info["total"]) == int(info["free"]) == int(info["devtotal"]) == 1 << 30
    whole = probe("info1", path=path, preload=False).fields("info1")
    assert int(whole["total"]) == int(whole["devtotal"]) == (1 << 32) - 1  # the 15 GiB card, saturated as the driver does
