"""Enforcement of the limit on every counted allocation path, checked against the fake
driver's own ground-truth counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu_harness import GIB_BYTES, MIB, probe

LIMIT = 4147 * MIB
PATHS = ["link", "dlsym", "procaddr"]


@pytest.mark.parametrize("path", PATHS)
def test_exact_limit_fits_and_one_more_byte_fails(path: str) -> None:
    result = probe("alloc", str(LIMIT), "alloc", "1", "fake", "0", "free", "0", "alloc", "1", "fake", "0",
                   path=path, env={"CUDA_DEVICE_MEMORY_LIMIT": "4147m"})
    assert result.rcs("alloc") == [0, 2, 0]
    assert result.rcs("free") == [0]
    before, after = result.fields("fake", 0), result.fields("fake", 1)
    assert int(before["allocs"]) == 1  # the refused request never reached the driver
    assert int(before["used"]) == LIMIT and int(before["peak"]) == LIMIT
    assert int(after["used"]) == 1


# (commands for one allocation, bytes the fake driver really allocates for it)
COUNTED = {
    "cuMemAlloc_v2": (["alloc", "300000"], 300000),
    "cuMemAllocManaged": (["managed", "300000"], 300000),
    "cuMemAllocPitch_v2": (["pitch", "1000", "300"], 1024 * 300),  # charged by the driver's pitch
    "cuMemAllocAsync": (["async", "300000"], 300000),
    "cuMemAllocFromPoolAsync": (["pool", "300000"], 300000),
    "cuMemCreate": (["create", "300000"], 300000),
    "cuArrayCreate_v2": (["array", "300", "250"], 300 * 250 * 4),
    "cuArray3DCreate_v2": (["array3d", "50", "50", "30"], 50 * 50 * 30 * 4),
    "cuMipmappedArrayCreate": (["mipmap", "256", "256", "3"], (65536 + 16384 + 4096) * 4),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("api", sorted(COUNTED))
def test_every_allocation_path_is_counted_and_released(api: str, path: str) -> None:
    command, size = COUNTED[api]
    limit = MIB
    fits = limit // size
    script = command * (fits + 1) + ["info", "fake", "0"]
    for i in range(fits):
        script += ["free", str(i)]
    script += ["info", "fake", "0"]
    result = probe(*script, path=path, env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    verb = command[0]
    assert result.rcs(verb) == [0] * fits + [2]
    full, empty = result.fields("fake", 0), result.fields("fake", 1)
    assert int(full["used"]) == fits * size and int(full["allocs"]) == fits
    assert int(result.fields("info", 0)["free"]) == limit - fits * size
    assert result.rcs("free") == [0] * fits
    assert int(empty["used"]) == 0
    assert int(result.fields("info", 1)["free"]) == limit


def test_per_thread_stream_variants_are_counted() -> None:
    result = probe("async", str(MIB), "async", "1", "pool", "1", "free", "0", "async", "1", "fake", "0",
                   path="procaddr", ptds=True, env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert result.rcs("async") == [0, 2, 0]
    assert result.rcs("pool") == [2]
    assert int(result.fields("fake")["used"]) == 1


def test_host_located_vmm_memory_is_not_device_usage() -> None:
    result = probe("create_host", str(10 * MIB), "create", str(MIB), "info",
                   env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert result.rcs("create_host") == [0]
    assert result.rcs("create") == [0]
    assert int(result.fields("info")["free"]) == 0


def test_free_of_untracked_pointer_reaches_the_driver() -> None:
    result = probe("freeptr", "0x1234", "fake", "0", env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    # The driver's own answer (CUDA_ERROR_INVALID_VALUE), never HAMi-core's -1.
    assert result.rcs("freeptr") == [1]
    assert int(result.fields("fake")["bad_frees"]) == 1


@pytest.mark.parametrize("how", ["legacy", "legacydl", "legacylink"])  # getproc @2000, dlsym, linked
def test_legacy_32_bit_alloc_is_refused_under_a_limit(how: str) -> None:
    """The v1 cuMemAlloc is never a way around the limit: refused (CUDA_ERROR_NOT_SUPPORTED)
    before the driver sees it, however it was found."""
    result = probe(how, "4096", "fake", "0", env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert result.rcs(how) == [801]
    assert int(result.fields("fake")["allocs"]) == 0


def test_legacy_32_bit_alloc_passes_through_without_a_limit() -> None:
    """Without a limit nothing is enforced; its free (the _v2 hook, untracked) reaches the driver."""
    result = probe("legacy", "4096", "legacydl", "4096", "legacylink", "4096", "fake", "0",
                   "free", "0", "free", "1", "free", "2", "fake", "0")
    assert result.rcs("legacy") + result.rcs("legacydl") + result.rcs("legacylink") == [0, 0, 0]
    assert int(result.fields("fake", 0)["used"]) == 3 * 4096
    assert result.rcs("free") == [0, 0, 0] and int(result.fields("fake", 1)["used"]) == 0


def test_legacy_32_bit_alloc_is_refused_when_only_the_shared_file_has_a_limit(tmp_path: Path) -> None:
    cache = str(tmp_path / "usage.cache")
    probe("info", env={"CUDA_DEVICE_MEMORY_SHARED_CACHE": cache, "CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    result = probe("legacy", "4096", "fake", "0", env={"CUDA_DEVICE_MEMORY_SHARED_CACHE": cache})
    assert result.rcs("legacy") == [801]
    assert int(result.fields("fake")["allocs"]) == 0


def test_null_out_pointers_never_crash() -> None:
    result = probe("allocnull", "infonull", "alloc", "1000", "infonull", env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert result.rcs("allocnull") == [1]  # the driver's CUDA_ERROR_INVALID_VALUE
    first, second = result.all_fields("infonull")
    assert first["rc"] == "0,0,0" and int(first["total"]) == MIB and int(first["free"]) == MIB
    assert int(second["free"]) == MIB - 1000


def test_no_current_context_reports_the_driver_error_without_charging() -> None:
    result = probe("noctx", "alloc", "100", "ctx", "0", "info", "fake", "0", env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert result.rcs("alloc") == [201]  # CUDA_ERROR_INVALID_CONTEXT
    assert int(result.fields("info")["free"]) == MIB
    assert int(result.fields("fake")["allocs"]) == 0


def test_mem_get_info_clamps_total_to_physical_memory() -> None:
    result = probe("alloc", str(MIB), "info", env={"CUDA_DEVICE_MEMORY_LIMIT": "100g"})
    info = result.fields("info")
    assert int(info["total"]) == 15360 * MIB and int(info["free"]) == 15359 * MIB


def test_free_then_reallocate_many_times_does_not_drift() -> None:
    script = ["alloc", str(MIB), "free", "0"] + sum((["alloc", str(MIB), "free", str(i)] for i in range(1, 200)), [])
    result = probe(*script, "alloc", str(MIB), "info", env={"CUDA_DEVICE_MEMORY_LIMIT": "1m"})
    assert set(result.rcs("alloc")) == {0}
    assert int(result.fields("info")["free"]) == 0


@pytest.mark.parametrize("path", PATHS)
def test_racing_threads_never_exceed_the_limit(path: str) -> None:
    size, limit = 100_000_000, 1 << 30  # 10 fit; 8 threads want up to 32
    result = probe("race", "8", "3000", str(size), "fake", "0", path=path,
                   env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    race, fake = result.fields("race"), result.fields("fake")
    assert int(race["other"]) == 0
    assert int(race["oom"]) > 0 and int(race["ok"]) > 0
    assert int(fake["peak"]) <= limit
    assert int(fake["used"]) == 0 and int(fake["allocs"]) == int(race["ok"])


def test_race_workload_does_exceed_the_limit_without_the_library() -> None:
    """Control for the race test: the same workload really overshoots when nothing enforces."""
    result = probe("race", "8", "3000", "100000000", "fake", "0", preload=False,
                   env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    assert int(result.fields("fake")["peak"]) > 1 << 30


UNCOUNTABLE = [("graphalloc", str(MIB)), ("graphnode", str(MIB))]


@pytest.mark.parametrize("path", ["link", "dlsym", "procaddr"])
@pytest.mark.parametrize("command", UNCOUNTABLE, ids=[c for c, _ in UNCOUNTABLE])
def test_graph_memory_is_refused_under_a_limit(command: tuple[str, str], path: str) -> None:
    result = probe(*command, "fake", "0", env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, path=path)
    assert result.rcs(command[0]) == [801]  # CUDA_ERROR_NOT_SUPPORTED, before the driver is called
    assert result.fields("fake")["peak"] == "0"


@pytest.mark.parametrize("command", UNCOUNTABLE, ids=[c for c, _ in UNCOUNTABLE])
def test_graph_memory_is_the_drivers_without_a_limit(command: tuple[str, str]) -> None:
    assert probe(*command).rcs(command[0]) == [0]


@pytest.mark.parametrize("path", ["link", "dlsym", "procaddr"])
def test_a_pool_release_threshold_never_reaches_the_driver_under_a_limit(path: str) -> None:
    # The client is told yes (cuda.core's memory resource stops on a refusal); the pool keeps
    # releasing freed memory at once, so the charge released at free stays true.
    limited = probe("poolthreshold", str(GIB_BYTES), "poolget", env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, path=path)
    assert limited.rcs("poolthreshold") == [0] and limited.fields("poolget")["threshold"] == "0"
    free = probe("poolthreshold", str(GIB_BYTES), "poolget", path=path)
    assert free.fields("poolget")["threshold"] == str(GIB_BYTES)  # without a limit: the driver's


def test_dlsym_on_a_driver_copy_in_another_namespace_gets_the_hook() -> None:
    # dlmopen(LM_ID_NEWLM) loads a second libcuda where no preload applies; dlsym on it still hands
    # out the hook, which forwards to our own driver copy (no context current there: nothing allocated).
    result = probe("alloc", str(2 * GIB_BYTES), "fake", "0", env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, path="dlmopen")
    assert result.rcs("alloc") != [0] and result.fields("fake")["peak"] == "0"
    unhooked = probe("alloc", str(2 * GIB_BYTES), env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, path="dlmopen", preload=False)
    assert unhooked.rcs("alloc") == [0]  # the copy itself allocates: the hook is what stops it


SIZES = [1, 2, 511, 512, 513, 4095, 4096, 4097, MIB - 1, MIB, MIB + 1, GIB_BYTES - 1, GIB_BYTES]


@pytest.mark.parametrize("path", ["link", "procaddr"])
def test_every_size_from_a_byte_to_the_whole_grant_is_charged_exactly_and_given_back(path: str) -> None:
    # Each size allocated alone and freed: exact at every rounding edge, and one byte past the
    # 1 GiB grant is refused before the driver sees it.
    commands = [c for i, size in enumerate(SIZES) for c in ("alloc", str(size), "free", str(i))]
    result = probe(*commands, "alloc", str(GIB_BYTES + 1), "fake", "0", env={"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, path=path)
    assert result.rcs("alloc") == [0] * len(SIZES) + [2] and result.rcs("free") == [0] * len(SIZES)
    fake = result.fields("fake")
    assert int(fake["used"]) == 0 and int(fake["peak"]) == GIB_BYTES and int(fake["allocs"]) == len(SIZES)
