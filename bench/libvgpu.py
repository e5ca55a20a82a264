"""Benchmark of libvgpu.so's cost on the allocation path: cuMemAlloc_v2 + cuMemFree_v2
pairs on the fake driver with and without the library, 1 and 8 threads, in one run.
Prints figures only; nothing here asserts on time."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HAMI = REPO / "hami-core"
FAKE = HAMI / "build" / "fake"
LIBVGPU = HAMI / "build" / "libvgpu.so"
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
PAIRS = int(os.environ.get("BENCH_PAIRS", "200000"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))
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


def run_once(exe: Path, threads: int, preload: bool) -> float:
    """Aggregate nanoseconds per pair (wall time / all pairs of all threads)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LD_PRELOAD", "FAKE_CUDA"))}
    env["LD_LIBRARY_PATH"] = str(FAKE)
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "4147m"
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(exe.parent / "usage.cache")  # never the host's /tmp default
    if preload:
        env["LD_PRELOAD"] = str(LIBVGPU)
    pairs = max(1, PAIRS // threads)
    out = subprocess.run([str(exe), str(threads), str(pairs), str(SIZE)], env=env, capture_output=True,
                         text=True, check=True).stdout
    return float(out) / (pairs * threads)


def measure(exe: Path, threads: int) -> tuple[float, float]:
    base, lib = [], []
    for _ in range(REPEATS):  # interleaved so drift hits both sides alike
        base.append(run_once(exe, threads, preload=False))
        lib.append(run_once(exe, threads, preload=True))
    return statistics.median(base), statistics.median(lib)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        print(f"libvgpu.so cuMemAlloc_v2+cuMemFree_v2 ({SIZE >> 20} MiB, {PAIRS} pairs, median of {REPEATS}, "
              f"{os.cpu_count()} CPUs, fake driver)")
        print(f"{'threads':>7} {'without ns/pair':>16} {'with ns/pair':>13} {'added ns':>9} {'ratio':>6}")
        for threads in (1, 8):
            base, lib = measure(exe, threads)
            print(f"{threads:>7} {base:>16.1f} {lib:>13.1f} {lib - base:>9.1f} {lib / base:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
