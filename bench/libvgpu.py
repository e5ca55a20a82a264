"""Benchmark of libvgpu.so's cost on the allocation path: cuMemAlloc_v2 + cuMemFree_v2
pairs on the fake driver without the library, with the single-process library of issue 4
(built from git when the history is there) and with today's shared-file library; 1 and 8
threads, then 1 against 4 processes contending on one accounting file. All in one run.
Prints figures only; nothing here asserts on time."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HAMI = REPO / "hami-core"
FAKE = HAMI / "build" / "fake"
LIBVGPU = HAMI / "build" / "libvgpu.so"
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
PAIRS = int(os.environ.get("BENCH_PAIRS", "200000"))
GROUP_PAIRS = int(os.environ.get("BENCH_GROUP_PAIRS", "1000000"))  # per process, in the 1-vs-4 runs
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))
SINGLE_PROCESS_COMMIT = "9547f27"  # last commit of issue 4: per-process atomics, no shared file
SIZE = 1 << 20


def build(workdir: Path) -> Path:
    subprocess.run(["make", "-s", "-C", str(HAMI)], check=True)
    exe = workdir / "libvgpu_bench"
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{CUDA_HOME}/include", "-o", str(exe),
         str(REPO / "bench" / "libvgpu_bench.c"), f"-L{FAKE}", "-l:libcuda.so.1", "-lpthread"],
        check=True,
    )
    return exe


def build_single_process_library(workdir: Path) -> Path | None:
    """The issue-4 library, exported from git history; None when that is not possible."""
    src = workdir / "single"
    src.mkdir()
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", SINGLE_PROCESS_COMMIT, "hami-core"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        subprocess.run(["make", "-s", "-C", str(src / "hami-core"), "build/libvgpu.so"], capture_output=True,
                       check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return src / "hami-core" / "build" / "libvgpu.so"


def bench_env(workdir: Path, library: Path | None, cache: str = "usage.cache") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LD_PRELOAD", "FAKE_CUDA"))}
    env["LD_LIBRARY_PATH"] = str(FAKE)
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "4147m"
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(workdir / cache)  # never the host's /tmp default
    if library:
        env["LD_PRELOAD"] = str(library)
    return env


def run_once(exe: Path, threads: int, library: Path | None) -> float:
    """Aggregate nanoseconds per pair (wall time inside the program / all pairs of all threads)."""
    pairs = max(1, PAIRS // threads)
    out = subprocess.run([str(exe), str(threads), str(pairs), str(SIZE)], env=bench_env(exe.parent, library),
                         capture_output=True, text=True, check=True).stdout
    return float(out) / (pairs * threads)


def run_group(exe: Path, processes: int, library: Path | None, cache: str) -> float:
    """Pairs per second of `processes` single-threaded processes sharing one accounting file,
    from the first start to the last exit (start-up is the same for 1 and 4)."""
    env = bench_env(exe.parent, library, cache)
    argv = [str(exe), "1", str(GROUP_PAIRS), str(SIZE)]
    start = time.perf_counter()
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL) for _ in range(processes)]
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError("benchmark process failed")
    return processes * GROUP_PAIRS / (time.perf_counter() - start)


def median_interleaved(*runs) -> list[float]:  # noqa: ANN002 - thunks
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(REPEATS):  # interleaved so drift hits every variant alike
        for i, run in enumerate(runs):
            samples[i].append(run())
    return [statistics.median(s) for s in samples]


def per_pair_table(exe: Path, single: Path | None) -> None:
    print(f"{'threads':>7} {'no lib ns':>10} {'issue-4 lib':>12} {'shared lib':>11} {'added ns':>9} "
          f"{'vs issue-4':>11} {'ratio':>6}")
    for threads in (1, 8):
        runs = [lambda: run_once(exe, threads, None), lambda: run_once(exe, threads, LIBVGPU)]
        if single:
            runs.append(lambda: run_once(exe, threads, single))
        base, shared, *rest = median_interleaved(*runs)
        old = f"{rest[0]:>12.1f}" if rest else f"{'n/a':>12}"
        delta = f"{shared - rest[0]:>+11.1f}" if rest else f"{'n/a':>11}"
        print(f"{threads:>7} {base:>10.1f} {old} {shared:>11.1f} {shared - base:>9.1f} {delta} {shared / base:>6.2f}")


def contention_table(exe: Path) -> None:
    print(f"\n1 vs 4 single-threaded processes, {GROUP_PAIRS} pairs each, one shared accounting file "
          f"(median of {REPEATS}, {os.cpu_count()} CPUs)")
    print(f"{'':>10} {'1 proc pairs/s':>15} {'4 procs pairs/s':>16} {'4/1':>6}")
    counter = iter(range(1 << 30))
    cache = lambda: f"group-{next(counter)}.cache"  # noqa: E731 - a fresh file per group
    rows = median_interleaved(lambda: run_group(exe, 1, None, cache()), lambda: run_group(exe, 4, None, cache()),
                              lambda: run_group(exe, 1, LIBVGPU, cache()), lambda: run_group(exe, 4, LIBVGPU, cache()))
    for name, one, four in (("no lib", rows[0], rows[1]), ("shared lib", rows[2], rows[3])):
        print(f"{name:>10} {one:>15,.0f} {four:>16,.0f} {four / one:>6.2f}")
    print(f"shared lib / no lib with 4 processes: {rows[3] / rows[1]:.2f}")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        single = build_single_process_library(Path(tmp))
        print(f"libvgpu.so cuMemAlloc_v2+cuMemFree_v2 ({SIZE >> 20} MiB, {PAIRS} pairs, median of {REPEATS}, "
              f"{os.cpu_count()} CPUs, fake driver); ns per pair")
        if not single:
            print(f"(issue-4 library not built: git history with {SINGLE_PROCESS_COMMIT} unavailable)")
        per_pair_table(exe, single)
        contention_table(exe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
