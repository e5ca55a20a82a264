"""One limit shared by every process using the same accounting file: cross-process races
(ground truth from the fake driver's shared counters), SIGKILL recovery, fork children, PID namespaces,
many short processes, limits owned by the file, and corrupt files failing closed."""

from __future__ import annotations

import os
import random
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kai_isolator.shared.usage_cache import FILE_SIZE, read_usage
from vgpu_harness import GIB_BYTES, MIB, TESTS_DIR, base_env, node_gpu, probe

LIMIT = "1g"


@pytest.fixture(autouse=True)
def node_ledger_dir(tmp_path: Path) -> Iterator[None]:
    """Every test here runs on one node-wide fake GPU, the ground truth shared_env reaches."""
    with node_gpu(tmp_path / "node-gpu"):
        yield


def shared_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "usage.cache"),
           "LD_LIBRARY_PATH": str(tmp_path / "node-gpu"), "CUDA_DEVICE_MEMORY_LIMIT": LIMIT}
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


def poll(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def waiting_for_lock(pid: int, path: str) -> bool:
    """The process has the file open and sleeps: the library polls a busy lock with pauses."""
    try:
        has_file = any(os.readlink(fd) == path for fd in Path(f"/proc/{pid}/fd").iterdir())
        return has_file and "sleep" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


LOCK_HOLDER = """
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_NONBLOCK)
whole_file = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
try:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, whole_file)
    print("locked", flush=True)
except BlockingIOError:  # some other program holds one already: as good for the test
    print("locked elsewhere", flush=True)
sys.stdin.read()  # holds it until the test closes stdin or kills this process
"""


def hold_lock(path: Path | str) -> subprocess.Popen[str]:
    """A foreign process that holds an OFD write lock on the whole of `path` and never lets go."""
    holder = subprocess.Popen(["python3", "-c", LOCK_HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    wait_for(holder, "locked")
    return holder


def fake_used(env: dict[str, str]) -> int:
    """The fake driver's cross-process ground truth (it releases dead processes' memory)."""
    return int(probe("fake", "0", env=env, preload=False, device=None).fields("fake")["used"])


def test_racing_processes_never_exceed_the_limit(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    go = tmp_path / "go"
    chunk = 200 * MIB
    procs = [spawn(env, "alloc", str(chunk), "alloc", str(chunk), "waitfile", str(go), "race", "1", "500", "100000000",
                   "alloc", str(chunk), "hold", "60000") for _ in range(8)]
    try:
        early = [wait_for(p, f"alloc {chunk}") + wait_for(p, f"alloc {chunk}") for p in procs]
        go.touch()  # every process holds its first two chunks until all have tried: 3.2 GB wanted of 1 GiB
        lines = [before + wait_for(p, "holding") for before, p in zip(early, procs)]
        rcs = [[int(line.split("rc=")[1].split()[0]) for line in out if line.startswith("alloc")] for out in lines]
        assert all(rc in (0, 2) for per in rcs for rc in per), lines
        assert sum(rc == 2 for per in rcs for rc in per[:2]) >= 16 - GIB_BYTES // chunk  # really contended
        races = [dict(kv.split("=") for kv in next(l for l in out if l.startswith("race")).split()[1:]) for out in lines]
        assert all(r["other"] == "0" for r in races), races
        held = chunk * sum(rc == 0 for per in rcs for rc in per)
        snap = read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
        assert snap.devices[0].used_bytes == held == fake_used(env) <= GIB_BYTES
        assert sum(p.used_bytes.get(0, 0) for p in snap.processes) == held
        fake = probe("fake", "0", env=env, preload=False, device=None).fields("fake")
        assert int(fake["peak"]) <= GIB_BYTES  # the driver's own cross-process ground truth
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    assert fake_used(env) == 0  # the driver released the killed processes' memory ...
    after = probe("info", env=env)
    assert int(after.fields("info")["free"]) == GIB_BYTES  # ... and so did the accounting
    assert read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).devices[0].used_bytes == 0


def test_fake_driver_releases_a_dead_processes_memory(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    holder = spawn(env | {"LD_PRELOAD": ""}, "alloc", str(3 * GIB_BYTES), "hold", "60000")
    wait_for(holder, "holding")
    assert fake_used(env) == 3 * GIB_BYTES
    holder.kill()
    holder.wait(timeout=10)
    assert fake_used(env) == 0


def test_killed_while_holding_the_lock_mid_update(tmp_path: Path) -> None:
    """The holder dies holding 1 GiB, the file lock, a half-done rebuild and an unfinished
    reservation; a process already waiting for the lock gets that GiB."""
    env = shared_env(tmp_path)
    holder = spawn(env, "alloc", str(GIB_BYTES), "crashstate", str(123 * MIB), "hold", "60000")
    lines = wait_for(holder, "holding")
    assert "alloc 1073741824 rc=0 id=0" in lines and "crashstate slot=-1" not in lines, lines
    waiter = spawn(env, "alloc", str(GIB_BYTES), "fake", "0")
    poll(lambda: waiting_for_lock(waiter.pid, env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0, err
    assert "alloc 1073741824 rc=0 id=0" in out.splitlines(), out
    assert err == "", err  # got the lock when the holder died: no lock timeout reported, no refusal
    snap = read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    assert snap.devices[0].used_bytes == 0  # the waiter exited after freeing; nothing of the holder is left
    assert fake_used(env) == 0


def test_processes_killed_at_random_moments_leave_exact_totals(tmp_path: Path) -> None:
    """Racing processes are SIGKILLed wherever they are (often inside a reservation or a
    rebuild); afterwards the whole limit is free again and the totals are exact."""
    env = shared_env(tmp_path)
    rng = random.Random(5)
    for _ in range(6):
        procs = [spawn(env, "alloc", "4096", "race", "2", "100000000", str(rng.choice([20, 40, 100]) * MIB))
                 for _ in range(3)]
        for p in procs:
            wait_for(p, "alloc 4096")  # attached and racing from here on
        for p in procs:
            time.sleep(rng.uniform(0.002, 0.03))  # only varies the moment of death
            p.kill()
        for p in procs:
            p.wait(timeout=10)
    assert fake_used(env) == 0
    result = probe("info", "alloc", str(GIB_BYTES), "fake", "0", env=env)
    assert int(result.fields("info")["free"]) == GIB_BYTES
    assert result.rcs("alloc") == [0]
    assert int(result.fields("fake")["used"]) == GIB_BYTES
    assert read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).devices[0].used_bytes == 0


def test_sigkilled_holder_is_reclaimed_by_the_next_process(tmp_path: Path) -> None:
    """How long that takes is measured in bench/library_startup.py."""
    env = shared_env(tmp_path)
    holder = spawn(env, "alloc", str(GIB_BYTES), "hold", "60000")
    assert "alloc 1073741824 rc=0 id=0" in wait_for(holder, "holding")
    blocked = probe("alloc", str(GIB_BYTES), env=env)
    assert blocked.rcs("alloc") == [2]
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    after = probe("alloc", str(GIB_BYTES), "info", env=env)
    assert after.rcs("alloc") == [0] and after.stderr == "", after.stderr
    assert int(after.fields("info")["free"]) == 0  # the whole GiB is the new process's: nothing of the dead one is counted
    assert read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).devices[0].used_bytes == 0  # and it freed it on exit


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


def test_an_execd_image_reattaches_and_its_predecessors_memory_is_free(tmp_path: Path) -> None:
    env = shared_env(tmp_path)
    result = probe("alloc", str(600 * MIB), "exec", "init", "ctx", "0", "alloc", str(600 * MIB), "info", "fake", "0",
                   env=env)
    assert result.rcs("alloc") == [0, 0]  # the exec freed the first 600 MiB (as the driver does)
    assert int(result.fields("info")["free"]) == GIB_BYTES - 600 * MIB
    assert int(result.fields("fake")["used"]) == 600 * MIB
    assert len(read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).processes) == 1  # one pid, one slot


def test_thousands_of_short_processes_do_not_exhaust_slots(tmp_path: Path) -> None:
    env = base_env(shared_env(tmp_path))
    argv = [str(TESTS_DIR / "cuprobe"), "init", "ctx", "0", "alloc", "1000", "hold", "0"]
    for _ in range(2000):  # nearly twice the 1024 slots; exiting processes leave theirs behind
        subprocess.run(argv, env=env, capture_output=True, check=True)
    last = probe("alloc", "1000", "info", env=shared_env(tmp_path))
    assert last.rcs("alloc") == [0]
    assert int(last.fields("info")["free"]) == GIB_BYTES - 1000
    snap = read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    assert len(snap.processes) <= 1024 and snap.devices[0].used_bytes == 0  # the last probe freed at exit


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


def test_an_unopenable_file_fails_closed_when_a_limit_is_set(tmp_path: Path) -> None:
    """A tenant could make the path unusable to escape the shared limit, so a limited process
    refuses to allocate; a process without any limit has nothing to enforce."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    for path in (tmp_path / "missing-dir" / "usage.cache", tmp_path / "a-file" / "usage.cache", tmp_path / "a-dir"):
        limited = probe("alloc", "1", "fake", "0", env=shared_env(tmp_path, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(path)))
        assert limited.rcs("alloc") == [2], path
        assert int(limited.fields("fake")["allocs"]) == 0
        assert len(limited.stderr.splitlines()) == 1 and str(path) in limited.stderr, limited.stderr
        unlimited = probe("alloc", "1", env={"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(path)})
        assert unlimited.rcs("alloc") == [0], path  # nothing to enforce, nothing to escape
        assert unlimited.stderr == ""


def test_a_file_that_is_not_a_regular_file_is_foreign(tmp_path: Path) -> None:
    """The file type is checked before any lock: a lock some other program holds on a device
    (dockerd holds one on /dev/null) is not waited for."""
    os.symlink("/dev/null", tmp_path / "to-dev-null")
    holder = hold_lock("/dev/null")
    try:
        for env in ({"CUDA_DEVICE_MEMORY_LIMIT": LIMIT}, {}):
            result = probe("alloc", "1", env=env | {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "to-dev-null")})
            assert result.rcs("alloc") == [2]
            assert "is not a regular file" in result.stderr and len(result.stderr.splitlines()) == 1
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_a_lock_held_forever_fails_closed_instead_of_hanging(tmp_path: Path) -> None:
    """Any process of the container can take the accounting file's lock and keep it (stopped,
    or on purpose): a process starting then, and one already running, each end with one line
    saying so and allocate nothing; once the lock is gone, allocations work again."""
    env = shared_env(tmp_path)
    path = env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    go = tmp_path / "go"
    running = spawn(env, "info", "waitfile", str(go), "alloc", "1", "fake", "0")
    wait_for(running, "info")  # attached, with no process slot yet: its first charge needs the lock
    holder = hold_lock(path)
    try:
        go.touch()
        out, err = running.communicate(timeout=60)
        assert "alloc 1 rc=2" in out.splitlines()[-2], out
        assert int(out.splitlines()[-1].split("allocs=")[1].split()[0]) == 0, out
        assert len(err.splitlines()) == 1 and "has been locked by another process" in err, err
        starting = probe("alloc", "1", "fake", "0", env=env)
        assert starting.rcs("alloc") == [2]
        assert int(starting.fields("fake")["allocs"]) == 0
        assert len(starting.stderr.splitlines()) == 1, starting.stderr
        assert f"{path} has been locked by another process" in starting.stderr
    finally:
        holder.kill()
        holder.wait(timeout=10)
    after = probe("alloc", "1", env=env)
    assert after.rcs("alloc") == [0] and after.stderr == ""


def _pid_namespace() -> list[str]:
    """A wrapper that runs a command in new user + PID (+ mount, for /proc) namespaces."""
    wrapper = ["unshare", "-r", "-p", "-f", "--kill-child", "--mount-proc"]
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is not installed")
    check = subprocess.run([*wrapper, "true"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        pytest.skip(f"new user+PID namespaces are not permitted here: {check.stderr.strip()}")
    return wrapper


def test_a_process_in_another_pid_namespace_cannot_wipe_live_usage(tmp_path: Path) -> None:
    """Liveness is the slot lock, not PID visibility: a process that cannot see the others'
    pids must still count their memory (the audit's escape: 800 MiB + 800 MiB under 1 GiB)."""
    wrapper = _pid_namespace()
    env = shared_env(tmp_path)
    outer = spawn(env, "alloc", str(800 * MIB), "hold", "60000")
    try:
        assert f"alloc {800 * MIB} rc=0 id=0" in wait_for(outer, "holding")
        inner = probe("info", "alloc", str(800 * MIB), "fake", "0", env=env, wrapper=wrapper)
        assert inner.rcs("alloc") == [2]
        assert int(inner.fields("info")["free"]) == GIB_BYTES - 800 * MIB
        fake = inner.fields("fake")
        assert int(fake["used"]) == 800 * MIB and int(fake["peak"]) <= GIB_BYTES
        assert read_usage(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).devices[0].used_bytes == 800 * MIB
        # The ground truth is not fooled either: an unlimited inner process adds to the outer's.
        raw = probe("alloc", str(800 * MIB), "fake", "0", env=env, preload=False, wrapper=wrapper)
        assert raw.rcs("alloc") == [0] and int(raw.fields("fake")["used"]) == 1600 * MIB
    finally:
        outer.kill()
        outer.wait(timeout=10)
    after = probe("alloc", str(GIB_BYTES), "fake", "0", env=env, wrapper=wrapper)
    assert after.rcs("alloc") == [0]  # a dead process is still reclaimed across namespaces
    assert int(after.fields("fake")["used"]) == GIB_BYTES


def test_an_inner_namespace_holder_counts_for_the_outer_processes(tmp_path: Path) -> None:
    wrapper = _pid_namespace()
    env = shared_env(tmp_path)
    argv = [str(TESTS_DIR / "cuprobe"), "--path=link", "init", "ctx", "0", "alloc", str(800 * MIB), "hold", "60000"]
    inner = subprocess.Popen([*wrapper, *argv], env=base_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert f"alloc {800 * MIB} rc=0 id=0" in wait_for(inner, "holding")
        outer = probe("alloc", str(800 * MIB), "fake", "0", env=env)
        assert outer.rcs("alloc") == [2]
        assert int(outer.fields("fake")["used"]) == 800 * MIB
    finally:
        inner.kill()  # --kill-child takes the namespace's processes with it
        inner.wait(timeout=10)
    poll(lambda: probe("alloc", str(GIB_BYTES), env=env).rcs("alloc") == [0])


def test_a_fork_childs_exit_leaves_the_parents_slot_alive(tmp_path: Path) -> None:
    """The child drops its inherited copy of the parent's open file description; the parent's
    slot lock must survive that, as seen by a third process."""
    env = shared_env(tmp_path)
    holder = spawn(env, "alloc", str(GIB_BYTES - 2 * MIB), "fork", str(MIB), "hold", "60000")
    try:
        lines = wait_for(holder, "holding")
        assert "fork exited=0" in lines, lines
        other = probe("alloc", str(3 * MIB), "alloc", str(2 * MIB), "fake", "0", env=env)
        assert other.rcs("alloc") == [2, 0]  # the exited child's MiB is free, the parent's usage is not
        assert int(other.fields("fake")["used"]) == GIB_BYTES
    finally:
        holder.kill()
        holder.wait(timeout=10)
