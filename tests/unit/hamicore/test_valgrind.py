"""The test programs and the library run clean under valgrind memcheck (skipped when
valgrind is not installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vgpu_harness import TESTS_DIR, base_env, probe, run_program

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


def test_shared_file_recovery_runs_clean_under_memcheck(node_ledger: dict[str, str], tmp_path: Path) -> None:
    """Rebuild after a holder died mid-update, and exec, under memcheck (fork children,
    which _exit holding memory on purpose, are not checked)."""
    env = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "usage.cache"), **node_ledger, "CUDA_DEVICE_MEMORY_LIMIT": "1g"}
    argv = [str(TESTS_DIR / "cuprobe"), "init", "ctx", "0", "alloc", str(1 << 30), "crashstate", "1000", "hold", "60000"]
    holder = subprocess.Popen(argv, env=base_env(env), stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    for line in holder.stdout:
        if line.startswith("holding"):
            break
    holder.kill()
    holder.wait(timeout=10)
    result = probe("alloc", str(1 << 30), "info", "fork", "1000", "free", "0", "fork", "1000", "exec", "init", "ctx",
                   "0", "alloc", "1000", "info", env=env, wrapper=MEMCHECK + ["--trace-children=yes", "--child-silent-after-fork=yes"], timeout=110,
                   check=False)
    assert result.returncode == 0, result.stderr
    assert result.rcs("alloc") == [0, 0]
    assert [f["rc"] for f in result.all_fields("child")] == ["2", "0"]
    assert [int(f["free"]) for f in result.all_fields("info")] == [0, (1 << 30) - 1000]
