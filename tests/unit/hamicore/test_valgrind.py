"""The test programs and the library run clean under valgrind memcheck (skipped when
valgrind is not installed)."""

from __future__ import annotations

import shutil

import pytest

from vgpu_harness import TESTS_DIR, probe, run_program

VALGRIND = shutil.which("valgrind")
pytestmark = pytest.mark.skipif(VALGRIND is None, reason="valgrind not installed")
MEMCHECK = [VALGRIND or "valgrind", "--quiet", "--error-exitcode=99", "--leak-check=full",
            "--errors-for-leak-kinds=definite,possible"]


def test_probe_runs_clean_under_memcheck() -> None:
    result = probe(
        "alloc", "1000", "managed", "1000", "pitch", "100", "10", "async", "1000", "pool", "1000", "create", "4096",
        "array", "10", "10", "array3d", "4", "4", "4", "mipmap", "16", "16", "3", "alloc", str(1 << 30),
        "freeptr", "0x1234", "info", "infonull", "totalmem", "0", "free", "0", "race", "4", "200", "100000",
        path="procaddr", env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"}, wrapper=MEMCHECK, timeout=110, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.rcs("alloc") == [0, 2]


def test_nvsmi_runs_clean_under_memcheck() -> None:
    result = run_program(MEMCHECK + [str(TESTS_DIR / "nvsmi"), "--path=dlsym"], {"CUDA_DEVICE_MEMORY_LIMIT": "4147m"},
                         timeout=110)
    assert result.returncode == 0, result.stderr
    assert "| 0MiB / 4147MiB |" in result.lines
