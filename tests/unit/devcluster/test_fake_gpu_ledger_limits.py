"""NVML 13.4's per-cgroup memory limits on the fake driver (issue 41): the API exactly as nvml.h declares it (an
ABI check against NVIDIA's header), and behind it the node's ledger enforcing them as an R615 driver does. Real
programs, linked to the fake driver by soname, run in cgroup v2 leaves the test makes and removes: a limit set as
root is read back with the cgroup's current use; an allocation past the hard limit fails with
CUDA_ERROR_OUT_OF_MEMORY and nothing is killed; inside the leaf cuMemGetInfo and nvmlDeviceGetMemoryInfo_v2 show
the device capped to the limit, outside it (its parent included) the whole device; every error code the header
names comes back where it says; and an R580 node has none of it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_isolator.services.devcluster.fake_gpu_ledger import FAKE_CONTEXT_OVERHEAD_BYTES as CONTEXT
from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu
from kai_isolator.services.devcluster.fake_gpu_ledger import MEMORY_LIMIT_MAX as MAX
from support.cgroups import NOBODY, Programs, make_tree, one, programs_on, rcs, readable_gpu, remove_tree, run, unique_top, v1_directory, v2_mount

HAMI = Path(__file__).resolve().parents[3] / "hami-core"
MIB = 1 << 20
CARD = 1024 * MIB
SUCCESS, INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, OPERATING_SYSTEM = 0, 2, 3, 4, 6, 17
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
GO_NVML = "github.com/NVIDIA/go-nvml@v0.13.4-1"  # its pkg/nvml/nvml.h is NVIDIA's NVML 13.4.92 header

MOUNT = v2_mount()
needs_leaves = pytest.mark.skipif(os.geteuid() != 0 or MOUNT is None,
                                  reason="makes cgroup v2 leaves and places programs in them (root, a cgroup2 mount)")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def node_gpu(branch: int) -> contextlib.AbstractContextManager[FakeGpu]:
    """A 1 GiB fake card of the given driver branch, in a folder every uid can read (as a node's driver folder)."""
    return readable_gpu(total_mib=CARD // MIB, driver_branch=branch)


@pytest.fixture
def gpu() -> Iterator[FakeGpu]:
    with node_gpu(615) as started:
        yield started


@pytest.fixture
def tree() -> Iterator[Path]:
    """pod/ctr (the container's leaf), pod/sidecar beside it, and other, a cgroup elsewhere."""
    assert MOUNT is not None
    top = make_tree(unique_top(MOUNT), "pod/ctr", "pod/sidecar", "other")
    try:
        yield top
    finally:
        remove_tree(top)


@pytest.fixture
def programs(gpu: FakeGpu, tree: Path) -> Iterator[Programs]:
    yield from programs_on(gpu)


def set_limit(gpu: FakeGpu, cgroup: Path | str, soft: int | str, hard: int | str, prefix: list[str] | None = None) -> int | str:
    return one(run(gpu, "init", "set", cgroup, soft, hard, prefix=prefix), "set")["rc"]


def get_limit(gpu: FakeGpu, cgroup: Path | str, prefix: list[str] | None = None) -> dict[str, int | str]:
    return one(run(gpu, "init", "get", cgroup, prefix=prefix), "get")


@needs_leaves
def test_a_limit_is_read_back_with_all_the_cgroups_processes_hold(gpu: FakeGpu, tree: Path, programs: Programs) -> None:
    leaf = tree / "pod" / "ctr"
    assert set_limit(gpu, leaf, 64 * MIB, 256 * MIB) == SUCCESS
    assert get_limit(gpu, leaf) == {"rc": SUCCESS, "soft": 64 * MIB, "hard": 256 * MIB, "used": 0}
    first = programs.start("init", "alloc", 100 * MIB, "wait", cgroup=leaf)
    second = programs.start("init", "alloc", 20 * MIB, "managed", 300 * MIB, "wait", cgroup=leaf)
    assert rcs(first.said(), "alloc") == rcs(second.said(), "alloc") == [SUCCESS]
    # Both processes, contexts and all; managed memory is not the device's as far as the limit goes. Reading needs
    # no root, and a reader elsewhere adds nothing.
    expected = {"rc": SUCCESS, "soft": 64 * MIB, "hard": 256 * MIB, "used": 2 * CONTEXT + 120 * MIB}
    assert get_limit(gpu, leaf, prefix=NOBODY) == expected
    first.finish()
    assert get_limit(gpu, leaf)["used"] == CONTEXT + 20 * MIB
    second.finish()
    assert get_limit(gpu, leaf)["used"] == 0


@needs_leaves
def test_past_the_hard_limit_an_allocation_fails_and_nothing_is_killed(gpu: FakeGpu, tree: Path, programs: Programs) -> None:
    leaf = tree / "pod" / "ctr"
    assert set_limit(gpu, leaf, 0, 256 * MIB) == SUCCESS
    first = programs.start("init", "alloc", 100 * MIB, "wait", "alloc", 1, "free", 0, "alloc", 64 * MIB, "wait", cgroup=leaf)
    assert rcs(first.said(), "alloc") == [SUCCESS]
    second = programs.start("init", "alloc", 148 * MIB, "alloc", 1, "ctx", "managed", 200 * MIB, "cuinfo", "wait", cgroup=leaf)
    filled = second.said()
    # 4 + 100 + 4 + 148 MiB: the limit exactly; one byte more fails, a context's overhead too; managed memory does not.
    assert rcs(filled, "alloc") == [SUCCESS, OUT_OF_MEMORY] and rcs(filled, "ctx") == [OUT_OF_MEMORY]
    assert rcs(filled, "managed") == [SUCCESS] and one(filled, "cuinfo") == {"rc": SUCCESS, "free": 0, "total": 256 * MIB}
    # The cgroup is full whoever in it asks; what it frees it may take again.
    assert first.go() == [("alloc", {"rc": OUT_OF_MEMORY}), ("free", {"rc": SUCCESS}), ("alloc", {"rc": SUCCESS})]
    elsewhere = run(gpu, "init", "alloc", 300 * MIB, cgroup=tree / "other")
    assert rcs(elsewhere, "alloc") == [SUCCESS]  # another cgroup owes this one's limit nothing
    assert gpu.processes() == {first.pid: CONTEXT + 64 * MIB, second.pid: CONTEXT + 148 * MIB + 200 * MIB}
    assert first.finish() == [] and second.finish() == []  # both ran on to their end and exited 0


@needs_leaves
def test_memory_info_is_capped_inside_the_leaf_and_nowhere_else(gpu: FakeGpu, tree: Path, programs: Programs) -> None:
    leaf, parent, sidecar = tree / "pod" / "ctr", tree / "pod", tree / "pod" / "sidecar"
    assert set_limit(gpu, leaf, 0, 256 * MIB) == SUCCESS
    inside = run(gpu, "init", "cuinfo", "nvinfo", "nvinfo1", cgroup=leaf)
    assert one(inside, "cuinfo") == {"rc": SUCCESS, "free": 256 * MIB - CONTEXT, "total": 256 * MIB}
    assert one(inside, "nvinfo") == {"rc": SUCCESS, "total": 256 * MIB, "free": 256 * MIB - CONTEXT, "used": CONTEXT}
    # nvmlDeviceGetMemoryInfo (the first version) is the device's: NVIDIA changed only _v2 for cgroups.
    assert one(inside, "nvinfo1") == {"rc": SUCCESS, "total": CARD, "free": CARD - CONTEXT, "used": CONTEXT}
    for outside in (parent, sidecar, tree / "other"):
        seen = run(gpu, "init", "cuinfo", "nvinfo", cgroup=outside)
        assert one(seen, "cuinfo") == {"rc": SUCCESS, "free": CARD - CONTEXT, "total": CARD}, outside
        assert one(seen, "nvinfo")["total"] == CARD, outside
    # A limit on the parent does not reach the leaves below it (NVIDIA measured as much on R615): limits go on leaves.
    assert set_limit(gpu, parent, 0, 128 * MIB) == SUCCESS
    below = run(gpu, "init", "cuinfo", "alloc", 200 * MIB, cgroup=sidecar)
    assert one(below, "cuinfo")["total"] == CARD and rcs(below, "alloc") == [SUCCESS]
    # Free is never more than the device has: with a neighbour holding all but 50 MiB, the leaf's room is 50 MiB.
    neighbour = programs.start("init", "alloc", CARD - 2 * CONTEXT - 50 * MIB, "wait", cgroup=tree / "other")
    assert rcs(neighbour.said(), "alloc") == [SUCCESS]
    squeezed = run(gpu, "init", "cuinfo", "nvinfo", cgroup=leaf)
    assert one(squeezed, "cuinfo") == {"rc": SUCCESS, "free": 50 * MIB, "total": 256 * MIB}
    assert one(squeezed, "nvinfo") == {"rc": SUCCESS, "total": 256 * MIB, "free": 50 * MIB, "used": CONTEXT}


@needs_leaves
def test_soft_0_and_hard_max_clear_a_limit(gpu: FakeGpu, tree: Path) -> None:
    leaf = tree / "pod" / "ctr"
    assert set_limit(gpu, leaf, 64 * MIB, 256 * MIB) == SUCCESS
    assert set_limit(gpu, leaf, 0, "max") == SUCCESS
    assert get_limit(gpu, leaf)["rc"] == NOT_FOUND
    cleared = run(gpu, "init", "cuinfo", "alloc", 512 * MIB, cgroup=leaf)
    assert one(cleared, "cuinfo")["total"] == CARD and rcs(cleared, "alloc") == [SUCCESS]
    # A soft limit alone (a request without a limit, in the toolkit's words) is kept and caps nothing.
    assert set_limit(gpu, leaf, 64 * MIB, "max") == SUCCESS
    assert get_limit(gpu, leaf) == {"rc": SUCCESS, "soft": 64 * MIB, "hard": MAX, "used": 0}
    assert one(run(gpu, "init", "cuinfo", cgroup=leaf), "cuinfo")["total"] == CARD


@needs_leaves
def test_removing_the_cgroup_clears_its_limit(gpu: FakeGpu, tree: Path) -> None:
    leaf = tree / "pod" / "ctr"
    assert set_limit(gpu, leaf, 0, 256 * MIB) == SUCCESS
    leaf.rmdir()
    assert get_limit(gpu, leaf)["rc"] == OPERATING_SYSTEM  # no cgroup there to ask about
    leaf.mkdir()  # a new cgroup at the same path: none of the old one's limits
    assert get_limit(gpu, leaf)["rc"] == NOT_FOUND
    assert one(run(gpu, "init", "cuinfo", cgroup=leaf), "cuinfo")["total"] == CARD


@needs_leaves
def test_a_process_moved_between_cgroups_is_charged_where_it_allocates(gpu: FakeGpu, tree: Path, programs: Programs) -> None:
    """The ledger reads the kernel's word for the process's cgroup at each allocation; what it took before it moved
    stays charged where it was taken (as the driver's cgroup accounting keeps it)."""
    leaf = tree / "pod" / "ctr"
    assert set_limit(gpu, leaf, 0, 64 * MIB) == SUCCESS
    mover = programs.start("init", "alloc", 100 * MIB, "wait", "alloc", 32 * MIB, "alloc", 40 * MIB, "cuinfo", "wait",
                           cgroup=tree / "other")
    assert rcs(mover.said(), "alloc") == [SUCCESS]
    (leaf / "cgroup.procs").write_text(str(mover.pid))
    moved = mover.go()
    assert rcs(moved, "alloc") == [SUCCESS, OUT_OF_MEMORY]
    assert one(moved, "cuinfo") == {"rc": SUCCESS, "free": 32 * MIB, "total": 64 * MIB}
    assert get_limit(gpu, leaf)["used"] == 32 * MIB


@needs_leaves
def test_every_invalid_limit_is_an_invalid_argument(gpu: FakeGpu, tree: Path) -> None:
    leaf = tree / "pod" / "ctr"
    invalid = [(200 * MIB, 100 * MIB),  # soft above hard
               (0, CARD + 1),  # a hard limit past the device's memory
               (CARD + 1, "max")]  # a soft limit past it
    for soft, hard in invalid:
        assert set_limit(gpu, leaf, soft, hard) == INVALID_ARGUMENT, (soft, hard)
    assert set_limit(gpu, "null", 0, 256 * MIB) == INVALID_ARGUMENT  # no nameSpace at all
    assert get_limit(gpu, "null")["rc"] == INVALID_ARGUMENT
    assert get_limit(gpu, leaf)["rc"] == NOT_FOUND  # none of them was set
    assert set_limit(gpu, leaf, CARD, CARD) == SUCCESS  # the whole device is a limit


@needs_leaves
def test_a_path_that_is_not_a_cgroup_v2_directory_is_an_operating_system_error(gpu: FakeGpu, tree: Path) -> None:
    """The header's "the cgroup path cannot be opened": nothing there, a file, a directory that is no cgroup, and a
    cgroup v1 directory (the driver needs cgroup v2)."""
    paths = [tree / "nowhere", tree / "pod" / "ctr" / "cgroup.procs", Path("/tmp")]
    v1 = v1_directory()
    if v1 is not None:
        paths.append(v1)
    for path in paths:
        assert set_limit(gpu, path, 0, 256 * MIB) == OPERATING_SYSTEM, path
        assert get_limit(gpu, path)["rc"] == OPERATING_SYSTEM, path


@needs_leaves
def test_setting_needs_root_and_reading_does_not(gpu: FakeGpu, tree: Path) -> None:
    leaf = tree / "pod" / "ctr"
    assert set_limit(gpu, leaf, 0, 128 * MIB, prefix=NOBODY) == NO_PERMISSION
    assert get_limit(gpu, leaf, prefix=NOBODY)["rc"] == NOT_FOUND  # nothing was set, and asking was allowed
    assert set_limit(gpu, leaf, 0, 128 * MIB) == SUCCESS
    assert get_limit(gpu, leaf, prefix=NOBODY) == {"rc": SUCCESS, "soft": 0, "hard": 128 * MIB, "used": 0}
    # Without root, even a path that cannot be opened is answered NO_PERMISSION first.
    assert set_limit(gpu, tree / "nowhere", 0, 128 * MIB, prefix=NOBODY) == NO_PERMISSION


@needs_leaves
def test_an_r580_node_has_no_limits(tree: Path) -> None:
    leaf = tree / "pod" / "ctr"
    with node_gpu(580) as gpu:
        steps = run(gpu, "init", "version", "set", leaf, 0, 256 * MIB, "get", leaf, "cuinfo", cgroup=leaf)
        assert one(steps, "version") == {"cuda": 13000, "driver": "580.65.06", "nvml": "13.580.65.06", "nvcuda": 13000}
        assert rcs(steps, "set") == rcs(steps, "get") == [NOT_SUPPORTED]
        assert one(steps, "cuinfo")["total"] == CARD
    # A GPU without a node ledger (one process's own, the fakes' in-process mode) has no R615 either.
    alone = run(HAMI / "build" / "fake", "init", "set", leaf, 0, 256 * MIB, "get", leaf)
    assert rcs(alone, "set") == rcs(alone, "get") == [NOT_SUPPORTED]


def test_an_r615_node_reports_its_versions(gpu: FakeGpu) -> None:
    steps = run(gpu, "init", "version")
    assert one(steps, "version") == {"cuda": 13040, "driver": "615.71.09", "nvml": "13.615.71.09", "nvcuda": 13040}


def test_the_declarations_match_nvidias_header(tmp_path: Path) -> None:
    """include/nvml_subset.h against NVML 13.4.92's nvml.h as go-nvml ships it: every struct's layout, every
    constant and return code, every signature (hami-core's `make nvml-abi-check`)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain to fetch NVIDIA's header through the module proxy")
    fetched = subprocess.run([go, "mod", "download", "-json", GO_NVML], cwd=tmp_path, capture_output=True, text=True,
                             env={**os.environ, "GOFLAGS": "-mod=mod"}, timeout=300, check=False)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    header = Path(json.loads(fetched.stdout)["Dir"]) / "pkg" / "nvml"
    checked = subprocess.run(["make", "-s", "-C", str(HAMI), "nvml-abi-check", f"NVML_REAL_INCLUDE={header}"],
                             capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
