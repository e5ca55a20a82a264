"""Benchmark of libvgpu.so's cost on the allocation path: cuMemAlloc_v2 + cuMemFree_v2
pairs on the fake driver without the library, with the single-process library of issue 4
(built from git when the history is there), with today's library on the environment contract
and under a node-written grant (as root: in a private mount namespace built as the webhook
mounts a container); 1 and 8 threads; start-up (init + context + one alloc + exit) with the
environment and with the grant; then 1 against 4 processes contending on one accounting file.
All in one run. Prints figures only; nothing here asserts on time."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kai_isolator.services.demo.kubelet import STARTED, Mount, namespace_script
from kai_isolator.shared.contract import GRANT_FILE, GRANT_MOUNT_PATH, STATE_MOUNT_PATH
from kai_isolator.shared.grant import DeviceGrant, Grant, GrantSource

REPO = Path(__file__).resolve().parent.parent
HAMI = REPO / "hami-core"
FAKE = HAMI / "build" / "fake"
LIBVGPU = HAMI / "build" / "libvgpu.so"
CUPROBE = HAMI / "build" / "tests" / "cuprobe"
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
PAIRS = int(os.environ.get("BENCH_PAIRS", "200000"))
GROUP_PAIRS = int(os.environ.get("BENCH_GROUP_PAIRS", "1000000"))  # per process, in the 1-vs-4 runs
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))
SINGLE_PROCESS_COMMIT = "9547f27"  # last commit of issue 4: per-process atomics, no shared file
SIZE = 1 << 20
STARTUPS = int(os.environ.get("BENCH_STARTUPS", "100"))  # process starts per start-up sample
FAKE_GPU_UUID = "GPU-0000fa4e-1111-2222-3333-000000000000"  # the fake NVML's device 0


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


_views = iter(range(1 << 30))


def container_view(workdir: Path, granted: bool) -> list[str]:
    """A prefix that runs a program in a private mount namespace with a writable state dir and,
    when `granted`, the node-written grant read-only at /etc/kai-isolator (never this machine's own)."""
    view = workdir / f"view-{next(_views)}"
    state, grant = view / "state", view / "grant"
    state.mkdir(parents=True)
    mounts = [Mount(state, STATE_MOUNT_PATH, False)]
    if granted:
        grant.mkdir()
        record = Grant(pod_uid="bench", namespace="bench", pod="bench", container="main", source=GrantSource.CONFIGMAP,
                       devices=(DeviceGrant(uuid=FAKE_GPU_UUID, limit_bytes=4147 << 20),))
        (grant / GRANT_FILE).write_text(record.model_dump_json())
        mounts.append(Mount(grant, GRANT_MOUNT_PATH, True))
    else:  # /etc is an overlay in both views (as in any container), so only the grant differs
        grant.mkdir()
        mounts.append(Mount(grant, GRANT_MOUNT_PATH + "-absent", True))
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", namespace_script(mounts, view / "scratch"), "sh"]


def grant_views_possible() -> bool:
    return os.geteuid() == 0


def run_once(exe: Path, threads: int, library: Path | None, granted: bool | None = None) -> float:
    """Aggregate nanoseconds per pair (wall time inside the program / all pairs of all threads);
    `granted` runs it in a container view with (True) or without (False) the grant mounted."""
    pairs = max(1, PAIRS // threads)
    prefix = container_view(exe.parent, granted) if granted is not None else []
    out = subprocess.run([*prefix, str(exe), str(threads), str(pairs), str(SIZE)], env=bench_env(exe.parent, library),
                         capture_output=True, text=True, check=True).stdout
    return float(out.replace(STARTED, "").split()[-1]) / (pairs * threads)


def run_startups(workdir: Path, granted: bool) -> float:
    """Milliseconds per process start (init + context + one 1 MiB alloc + exit), STARTUPS of them in one view."""
    loop = f'i=0; while [ $i -lt {STARTUPS} ]; do "$0" init ctx 0 alloc {SIZE} >/dev/null || exit 1; i=$((i+1)); done'
    start = time.perf_counter()
    subprocess.run([*container_view(workdir, granted), "sh", "-c", loop, str(CUPROBE)], env=bench_env(workdir, LIBVGPU),
                   capture_output=True, check=True)
    return (time.perf_counter() - start) * 1000 / STARTUPS


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
    granted = grant_views_possible()
    print(f"{'threads':>7} {'no lib ns':>10} {'issue-4 lib':>12} {'shared lib':>11} {'added ns':>9} "
          f"{'vs issue-4':>11} {'ratio':>6} {'grant lib':>10} {'grant-env':>10}")
    for threads in (1, 8):
        runs = [lambda: run_once(exe, threads, None), lambda: run_once(exe, threads, LIBVGPU)]
        if granted:
            runs.append(lambda: run_once(exe, threads, LIBVGPU, granted=True))
        if single:
            runs.append(lambda: run_once(exe, threads, single))
        base, shared, *rest = median_interleaved(*runs)
        grant = rest.pop(0) if granted else None
        old = f"{rest[0]:>12.1f}" if rest else f"{'n/a':>12}"
        delta = f"{shared - rest[0]:>+11.1f}" if rest else f"{'n/a':>11}"
        with_grant = f"{grant:>10.1f} {grant - shared:>+10.1f}" if grant is not None else f"{'n/a (root)':>10} {'':>10}"
        print(f"{threads:>7} {base:>10.1f} {old} {shared:>11.1f} {shared - base:>9.1f} {delta} {shared / base:>6.2f} {with_grant}")


def startup_table(workdir: Path) -> None:
    if not grant_views_possible():
        print("\nstart-up under a grant: n/a (needs root for a private mount namespace)")
        return
    env, grant = median_interleaved(lambda: run_startups(workdir, False), lambda: run_startups(workdir, True))
    print(f"\nstart-up (init + context + one alloc + exit), ms per process, {STARTUPS} per sample, median of {REPEATS}")
    print(f"{'environment':>12} {'grant':>8} {'grant/env':>10}")
    print(f"{env:>12.3f} {grant:>8.3f} {grant / env:>10.3f}")


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
        startup_table(Path(tmp))
        contention_table(exe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
