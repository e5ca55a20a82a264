"""The library must be invisible to programs that do not use CUDA, keep dlsym(RTLD_NEXT)
chains working, and stay quiet unless asked."""

from __future__ import annotations

import sys

from vgpu_harness import MIB, TESTS_DIR, probe, run_program

NOISY_ENV = {"CUDA_DEVICE_MEMORY_LIMIT": "not-a-size", "LIBCUDA_LOG_LEVEL": "4"}


def test_non_cuda_program_is_unaffected() -> None:
    plain = run_program([str(TESTS_DIR / "noncuda")], preload=False)
    preloaded = run_program([str(TESTS_DIR / "noncuda")], NOISY_ENV)
    assert plain.returncode == preloaded.returncode == 0
    # The same signal handlers as without the library (not "none": a runner under nohup hands SIGHUP down ignored).
    assert preloaded.stdout == plain.stdout
    assert "puts=1" in preloaded.stdout and "missing=1" in preloaded.stdout
    assert preloaded.stderr == ""


def test_shell_and_python_run_unchanged_under_the_library() -> None:
    shell = run_program(["/bin/sh", "-c", "echo hello; umask"], NOISY_ENV)
    assert shell.returncode == 0 and shell.stdout.splitlines()[0] == "hello" and shell.stderr == ""
    plain_umask = run_program(["/bin/sh", "-c", "umask"], preload=False).stdout
    assert shell.stdout.splitlines()[1] == plain_umask.strip()
    py = run_program([sys.executable, "-c", "import ctypes, json; print(json.dumps([1, 2]))"], NOISY_ENV)
    assert py.returncode == 0 and py.stdout.strip() == "[1, 2]" and py.stderr == ""


def test_rtld_next_chains_keep_their_caller() -> None:
    result = run_program([str(TESTS_DIR / "rtld_next")])
    assert result.returncode == 0, result.stdout
    assert "match=1" in result.stdout


def test_hook_without_any_driver_returns_an_error_instead_of_crashing() -> None:
    result = run_program([str(TESTS_DIR / "noncuda"), "call-hook"], {"LD_LIBRARY_PATH": "/nonexistent"})
    assert result.returncode == 0
    assert "hook=1 rc=3" in result.stdout  # CUDA_ERROR_NOT_INITIALIZED
    assert result.stderr == ""


def test_cuda_program_is_silent_by_default() -> None:
    result = probe("alloc", str(MIB), "alloc", str(MIB), "info", env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert result.rcs("alloc") == [0, 2]
    assert result.stderr == ""
