"""Benchmark of libvgpu.so's start-up and shared-lock cost, against the same cuprobe run without the library
(no LD_PRELOAD) in the same run, on a node-wide fake GPU. Prints figures only; nothing here asserts on time."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu

REPO = Path(__file__).resolve().parent.parent
HAMI = REPO / "hami-core"
LIBVGPU = HAMI / "build" / "libvgpu.so"
CUPROBE = HAMI / "build" / "tests" / "cuprobe"
GIB, MIB = 1 << 30, 1 << 20
STARTUPS = int(os.environ.get("BENCH_STARTUPS", "50"))  # process starts per start-up sample
REPEATS = int(os.environ.get("BENCH_REPEATS", "9"))
WAIT_S = 30.0  # bound on any one condition the bench waits for


class Bench:
    """One fake GPU and a fresh accounting file per sample, so no sample inherits another's slots."""

    def __init__(self, workdir: Path, gpu: FakeGpu) -> None:
        self.workdir = workdir
        self.gpu = gpu
        self._caches = iter(range(1 << 30))

    def env(self, library: bool, cache: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LD_PRELOAD", "FAKE_CUDA", "LIBCUDA_"))}
        env |= {"LD_LIBRARY_PATH": str(self.gpu.folder), "CUDA_DEVICE_MEMORY_LIMIT": "1g",
                "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(cache)}  # never the host's /tmp default
        if library:
            env["LD_PRELOAD"] = str(LIBVGPU)
        return env

    def cache(self) -> Path:
        return self.workdir / f"usage-{next(self._caches)}.cache"

    def startups(self, library: bool) -> float:
        """Milliseconds per process: init + context + one 1 MiB alloc + exit, STARTUPS in a row on one file."""
        env = self.env(library, self.cache())
        argv = [str(CUPROBE), "--path=link", "init", "ctx", "0", "alloc", str(MIB)]
        start = time.perf_counter()
        for _ in range(STARTUPS):
            subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=True)
        return (time.perf_counter() - start) * 1000 / STARTUPS

    def after_a_killed_holder(self, library: bool) -> float:
        """Milliseconds for a process to start, allocate 1 GiB and exit just after a 1 GiB holder was SIGKILLed
        (with the library: it finds the dead process's slot and reclaims it under the file lock)."""
        env = self.env(library, self.cache())
        holder = self.spawn(env, "alloc", str(GIB), "hold", "600000")
        self.read_until(holder, "holding")
        holder.kill()
        holder.wait(WAIT_S)
        start = time.perf_counter()
        self.allocate(env, GIB)
        return (time.perf_counter() - start) * 1000

    def lock_handover(self, library: bool) -> float:
        """Milliseconds from SIGKILL of a process that holds the file lock mid-update to a 1 GiB allocation done
        and its process exited: with the library, a process already waiting for that lock; without, the same
        probe started at the kill (nothing of the library to wait for)."""
        cache = self.cache()
        locked = self.env(True, cache)
        holder = self.spawn(locked, "alloc", str(GIB), "crashstate", str(123 * MIB), "hold", "600000")
        lines = self.read_until(holder, "holding")
        if any(line.startswith("crashstate slot=-1") for line in lines):
            raise RuntimeError(f"the holder never got the lock: {lines}")
        if not library:
            holder.kill()
            start = time.perf_counter()
            self.allocate(self.env(False, cache), GIB)
            elapsed = time.perf_counter() - start
            holder.wait(WAIT_S)
            return elapsed * 1000
        waiter = self.spawn(locked, "alloc", str(GIB))
        until(lambda: waiting_for_lock(waiter.pid, cache), f"pid {waiter.pid} waiting for the lock on {cache}")
        holder.kill()
        start = time.perf_counter()
        out, err = waiter.communicate(timeout=WAIT_S)
        elapsed = time.perf_counter() - start
        holder.wait(WAIT_S)
        if waiter.returncode != 0 or f"alloc {GIB} rc=0" not in out:
            raise RuntimeError(f"the waiter did not allocate: {out} {err}")
        return elapsed * 1000

    @staticmethod
    def spawn(env: dict[str, str], *commands: str) -> subprocess.Popen[str]:
        argv = [str(CUPROBE), "--path=link", "init", "ctx", "0", *commands]
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def read_until(process: subprocess.Popen[str], text: str) -> list[str]:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line.strip())
            if text in line:
                return lines
        raise RuntimeError(f"{text!r} never printed: {lines}")

    @staticmethod
    def allocate(env: dict[str, str], nbytes: int) -> None:
        argv = [str(CUPROBE), "--path=link", "init", "ctx", "0", "alloc", str(nbytes)]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=WAIT_S).stdout
        if f"alloc {nbytes} rc=0" not in out:
            raise RuntimeError(f"allocation refused: {out}")


def waiting_for_lock(pid: int, cache: Path) -> bool:
    """The process has the accounting file open and sleeps: the library polls a busy lock with pauses."""
    try:
        has_file = any(os.readlink(fd) == str(cache) for fd in Path(f"/proc/{pid}/fd").iterdir())
        return has_file and "sleep" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not reached in {WAIT_S} s: {what}")
        time.sleep(0.001)


def median_interleaved(*runs: Callable[[], float]) -> list[float]:
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(REPEATS):  # interleaved so drift hits every variant alike
        for i, run in enumerate(runs):
            samples[i].append(run())
    return [statistics.median(s) for s in samples]


def main() -> int:
    subprocess.run(["make", "-s", "-C", str(HAMI)], check=True)
    with tempfile.TemporaryDirectory() as tmp, FakeGpu(Path(tmp) / "gpu") as gpu:
        bench = Bench(Path(tmp), gpu)
        print(f"libvgpu.so start-up and lock cost against the same cuprobe without it (fake GPU, 1 GiB limit, "
              f"{os.cpu_count()} CPUs); ms, median of {REPEATS}")
        print(f"{'':<52} {'no lib':>8} {'libvgpu':>8} {'lib/no lib':>11}")
        rows = {
            f"start-up: init+ctx+1 MiB alloc+exit (x{STARTUPS})": bench.startups,
            "next process after a SIGKILLed 1 GiB holder": bench.after_a_killed_holder,
            "lock holder SIGKILLed -> waiter's 1 GiB alloc done": bench.lock_handover,
        }
        for name, run in rows.items():
            plain, preloaded = median_interleaved(lambda: run(False), lambda: run(True))
            print(f"{name:<52} {plain:>8.3f} {preloaded:>8.3f} {preloaded / plain:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
