"""One limit shared by every process using the same accounting file: cross-process races
(ground truth from the fake driver's shared counters), SIGKILL recovery, fork children,
many short processes, limits owned by the file, and corrupt files failing closed."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import time
from pathlib import Path

from kai_isolator.shared.usage_cache import FILE_SIZE, read_usage
from vgpu_harness import GIB_BYTES, MIB, TESTS_DIR, base_env, probe

LIMIT = "1g"


def shared_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "usage.cache"),
           "FAKE_CUDA_STATE": str(tmp_path / "fake.state"), "CUDA_DEVICE_MEMORY_LIMIT": LIMIT}
    env.update(extra)
    return env


def spawn(env: dict[str, str], *commands: str) -> subprocess.Popen[str]:
    argv = [str(TESTS_DIR / "cuprobe"), "--path=link", "init", "ctx", "0", *commands]
    return subprocess.Popen(argv, env=base_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen[str], text: str) -> list[str]:
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never printed: {lines}")


def test_racing_processes_never_exceed_the_limit(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    procs = [spawn(env, "race", "1", "500", "100000000") for _ in range(8)]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    totals = probe("fake", "0", "info", env=env)
    fake = totals.fields("fake")
    assert int(fake["peak"]) <= GIB_BYTES  # the driver's own cross-process ground truth
    assert sum(" oom=0 " not in out for out, _ in outputs) > 0  # the limit really was contended
    assert int(fake["used"]) == 0
    snap = read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    assert snap.devices[0].used_bytes == int(fake["used"]) == 0
    assert snap.devices[0].limit_bytes == GIB_BYTES


def test_sigkilled_holder_is_reclaimed_within_a_second(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    holder = spawn(env, "alloc", str(GIB_BYTES), "hold", "60000")
    assert "alloc 1073741824 rc=0 id=0" in wait_for(holder, "holding")
    blocked = probe("alloc", str(GIB_BYTES), env=env)
    assert blocked.rcs("alloc") == [2]
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    start = time.monotonic()
    after = probe("alloc", str(GIB_BYTES), env=env)
    assert after.rcs("alloc") == [0]
    assert time.monotonic() - start < 1.0


def test_reader_agrees_with_the_library_while_a_process_runs(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    holder = spawn(env, "alloc", str(300 * MIB), "managed", str(5 * MIB), "info", "hold", "60000")
    lines = wait_for(holder, "holding")
    try:
        info = dict(kv.split("=") for kv in next(line for line in lines if line.startswith("info")).split()[1:])
        snap = read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
        assert snap.devices[0].used_bytes == 305 * MIB == GIB_BYTES - int(info["free"])
        assert [(p.pid, p.used_bytes) for p in snap.processes] == [(holder.pid, {0: 305 * MIB})]
        assert snap.last_update_ns > 0
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_fork_child_gets_its_own_slot_and_its_usage_goes_when_it_exits(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    result = probe("alloc", str(GIB_BYTES - MIB), "fork", str(2 * MIB), "fork", str(MIB), "info", env=env)
    children = result.all_fields("child")
    assert [c["rc"] for c in children] == ["2", "0"]  # the child shares the parent's limit
    assert int(result.fields("info")["free"]) == MIB  # the exited child's MiB was reclaimed


def test_thousands_of_short_processes_do_not_exhaust_slots(tmp_path: Path) -> None:
    env = base_env(shared_env(tmp_path))
    argv = [str(TESTS_DIR / "cuprobe"), "init", "ctx", "0", "alloc", "1000"]
    for _ in range(1100):  # more than the 1024 slots, none of which is ever released at exit
        subprocess.run(argv, env=env, capture_output=True, check=True)
    last = probe("alloc", "1000", "info", env=shared_env(tmp_path))
    assert last.rcs("alloc") == [0]
    assert int(last.fields("info")["free"]) == GIB_BYTES - 1000


def test_two_processes_created_at_the_same_instant_agree(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    procs = [spawn(env, "alloc", str(600 * MIB), "hold", "1000") for _ in range(2)]
    outputs = [p.communicate(timeout=30)[0] for p in procs]
    rcs = sorted(line.split("rc=")[1].split()[0] for out in outputs for line in out.splitlines()
                 if line.startswith("alloc"))
    assert rcs == ["0", "2"]  # one file, one limit: 2 x 600 MiB cannot both fit in 1 GiB


def test_the_file_owns_the_limits(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    probe("info", env=env)
    later = probe("totalmem", "0", "alloc", str(GIB_BYTES + 1), env=shared_env(tmp_path, CUDA_DEVICE_MEMORY_LIMIT="8g"))
    assert int(later.fields("totalmem")["bytes"]) == GIB_BYTES
    assert later.rcs("alloc") == [2]
    assert len(later.stderr.splitlines()) == 1 and "keeping the shared file's limits" in later.stderr


def _corrupt(path: Path, kind: str) -> None:
    if kind == "truncated":
        path.write_bytes(b"\0" * 100)
    elif kind == "foreign":
        path.write_bytes(struct.pack("<I", 19920718) + b"\1" * (FILE_SIZE - 4))
    else:  # right magic, other version
        path.write_bytes(struct.pack("<II", 0x55504756, 7) + b"\0" * (FILE_SIZE - 8))


def test_corrupt_truncated_or_foreign_files_fail_closed(tmp_path: Path) -> None:
    for kind in ("truncated", "foreign", "version"):
        env = shared_env(tmp_path)
        _corrupt(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]), kind)
        result = probe("alloc", "1", "info", "fake", "0", env=env)
        assert result.rcs("alloc") == [2], kind
        assert len(result.stderr.splitlines()) == 1 and "shared accounting file" in result.stderr, kind
        assert os.path.getsize(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]) != 0
        assert int(result.fields("fake")["allocs"]) == 0
