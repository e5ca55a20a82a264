"""The three interception paths (exported names, dlsym on a driver handle,
cuGetProcAddress), version selection, NVML, and what the library exports."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kai_isolator.services.devcluster.fake_gpu_ledger import FAKE_CONTEXT_OVERHEAD_BYTES as CONTEXT
from vgpu_harness import HAMI, LIBVGPU, MIB, TESTS_DIR, base_env, probe, run_program

LEGACY, PER_THREAD = "1", "2"


@pytest.mark.parametrize(
    ("symbol", "version", "flags", "obj", "sym"),
    [
        ("cuMemAlloc", "13000", LEGACY, "libvgpu.so", "cuMemAlloc_v2"),
        ("cuMemAlloc", "3020", LEGACY, "libvgpu.so", "cuMemAlloc_v2"),
        ("cuMemAlloc", "3010", LEGACY, "libvgpu.so", "cuMemAlloc"),  # older ABI: the v1 hook, never the _v2 one
        ("cuMemAllocAsync", "12000", LEGACY, "libvgpu.so", "cuMemAllocAsync"),
        ("cuMemAllocAsync", "12000", PER_THREAD, "libvgpu.so", "cuMemAllocAsync_ptsz"),
        ("cuMemFreeAsync", "12000", PER_THREAD, "libvgpu.so", "cuMemFreeAsync_ptsz"),
        ("cuMemGetInfo", "13000", LEGACY, "libvgpu.so", "cuMemGetInfo_v2"),
        ("cuDeviceTotalMem", "13000", LEGACY, "libvgpu.so", "cuDeviceTotalMem_v2"),
        ("cuGetProcAddress", "12000", LEGACY, "libvgpu.so", "cuGetProcAddress_v2"),
        ("cuGetProcAddress", "11030", LEGACY, "libvgpu.so", "cuGetProcAddress"),
        ("cuInit", "13000", LEGACY, "libcuda.so.1", "cuInit"),  # not hooked: untouched
        ("cuCtxGetDevice", "13000", PER_THREAD, "libcuda.so.1", "cuCtxGetDevice"),
    ],
)
def test_get_proc_address_returns_the_hook_for_the_requested_version(
    symbol: str, version: str, flags: str, obj: str, sym: str
) -> None:
    result = probe("procaddr", symbol, version, flags, path="dlsym", device=None)
    fields = result.fields("procaddr")
    assert (fields["rc"], fields["obj"], fields["sym"]) == ("0", obj, sym)


def test_get_proc_address_passes_driver_errors_through() -> None:
    result = probe("procaddr", "cuNoSuchThing", "13000", LEGACY, "procaddr", "cuMemAllocAsync", "11000", LEGACY,
                   path="dlsym", device=None)
    missing, too_old = result.all_fields("procaddr")
    assert (missing["rc"], missing["status"], missing["obj"]) == ("500", "1", "none")
    assert (too_old["rc"], too_old["status"]) == ("500", "2")


def test_without_the_library_the_driver_answers_itself() -> None:
    result = probe("procaddr", "cuMemAlloc", "13000", LEGACY, path="dlsym", device=None, preload=False)
    assert result.fields("procaddr")["obj"] == "libcuda.so.1"


@pytest.mark.parametrize("path", ["link", "dlsym"])
def test_nvml_shows_the_limit_like_nvidia_smi(path: str) -> None:
    result = run_program([str(TESTS_DIR / "nvsmi"), f"--path={path}"], {"CUDA_DEVICE_MEMORY_LIMIT": "4147m"})
    assert result.returncode == 0, result.stderr
    assert "| 0MiB / 4147MiB |" in result.lines
    gpu = result.fields("gpu")
    assert gpu["rc"] == "0,0,0,2"  # NULL out-pointer: the driver's error, no crash
    assert int(gpu["total"]) == 4147 * MIB and int(gpu["free"]) == 4147 * MIB and gpu["used"] == "0"
    assert result.stderr == ""


def test_nvml_without_limit_reports_the_physical_card() -> None:
    result = run_program([str(TESTS_DIR / "nvsmi")])
    assert "| 0MiB / 15360MiB |" in result.lines


def test_nvml_per_device_limits() -> None:
    env = {"FAKE_CUDA_DEVICES": "2", "CUDA_DEVICE_MEMORY_LIMIT_0": "1g", "CUDA_DEVICE_MEMORY_LIMIT_1": "2048m"}
    result = run_program([str(TESTS_DIR / "nvsmi"), "--path=dlsym"], env)
    assert [line for line in result.lines if line.startswith("|")] == ["| 0MiB / 1024MiB |", "| 0MiB / 2048MiB |"]


def _exported(path: str) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None, reason="binutils absent")
def test_only_intended_symbols_are_exported_and_no_driver_is_linked() -> None:
    mapfile = (HAMI / "exports.map").read_text()
    global_block = mapfile.split("global:", 1)[1].split("local:", 1)[0]
    intended = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", global_block))
    assert _exported(str(LIBVGPU)) == intended
    needed = subprocess.run(["readelf", "-d", str(LIBVGPU)], capture_output=True, text=True, check=True).stdout
    assert "libcuda" not in needed and "libnvidia-ml" not in needed


def test_nvml_never_reports_more_than_the_card() -> None:
    # A grant larger than the card (32g on the 15360 MiB fake): NVML shows the card, as cuMemGetInfo does.
    gpu = run_program([str(TESTS_DIR / "nvsmi")], {"CUDA_DEVICE_MEMORY_LIMIT": "32g"}).fields("gpu")
    assert int(gpu["total"]) == int(gpu["free"]) == 15360 * MIB
    info = probe("info", env={"CUDA_DEVICE_MEMORY_LIMIT": "32g"}).fields("info")
    assert int(info["total"]) == 15360 * MIB


def test_nvml_never_reports_more_free_than_the_card_has(node_ledger: dict[str, str]) -> None:
    # Another container holds 14 GiB of the card (and its context's overhead); this one has a 4g grant
    # and holds nothing.
    ledger = node_ledger
    neighbour = subprocess.Popen([str(TESTS_DIR / "cuprobe"), "init", "ctx", "0", "alloc", str(14336 * MIB), "hold", "60000"],
                                 env=base_env(ledger, preload=False), stdout=subprocess.PIPE, text=True)
    try:
        assert neighbour.stdout is not None
        while "holding" not in neighbour.stdout.readline():
            pass
        limited = {**ledger, "CUDA_DEVICE_MEMORY_LIMIT": "4g"}
        gpu = run_program([str(TESTS_DIR / "nvsmi")], limited).fields("gpu")  # a process that never loaded libcuda
        assert int(gpu["total"]) == 4096 * MIB and int(gpu["free"]) == 1024 * MIB - CONTEXT and gpu["used"] == "0"
        info = probe("info", env=limited).fields("info")
        assert int(info["free"]) == 1024 * MIB - 2 * CONTEXT  # the same rule as cuMemGetInfo (its own context too)
        whole = run_program([str(TESTS_DIR / "nvsmi")], ledger, preload=False).fields("gpu")
        assert int(whole["used"]) == 14336 * MIB + CONTEXT  # NVML's device-wide view, as the real one's
    finally:
        neighbour.kill()
        neighbour.wait()
