"""The enforcer's NVML reader against the fake NVML: real processes allocating through the fake driver,
read back by host PID through every entry-point version and nvml.h's count / INSUFFICIENT_SIZE contract.
Each process's figure is what the node's fake-gpu ledger charges it: its allocations and its context's overhead."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_isolator.services.nodeagent import enforce
from kai_isolator.services.devcluster.fake_gpu_ledger import FAKE_CONTEXT_OVERHEAD_BYTES as CONTEXT
from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu
from kai_isolator.services.nodeagent.nvml import (
    NVML_ERROR_INSUFFICIENT_SIZE, NVML_SUCCESS, Nvml, NvmlError, ProcessInfoV1, ProcessInfoV2,
)
from support.nodeagent import FAKE_DIR, HAMI, MIB

CUPROBE = HAMI / "build" / "tests" / "cuprobe"
NO_LEDGER_NVML = str(FAKE_DIR / "libnvidia-ml.so.1")  # the build's copy: no fake-gpu ledger beside it
UUID0 = "GPU-0000fa4e-1111-2222-3333-000000000000"


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
    """A node's fake GPU of two devices: its ledger beside the copy of the fake libraries in its folder."""
    for knob in ("FAKE_NVML_PROCESS_API", "FAKE_NVML_GRAPHICS", "FAKE_NVML_USED", "FAKE_CUDA_TOTAL_MIB", "FAKE_CUDA_DEVICES"):
        monkeypatch.delenv(knob, raising=False)
    with FakeGpu(tmp_path / "driver", devices=2) as started:
        yield started


class Holders:
    """cuprobe processes that allocate on a device through the fake driver and keep it."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LD_LIBRARY_PATH": str(gpu.folder)}
        self.nvml = str(gpu.nvml)
        self.procs: list[subprocess.Popen[str]] = []

    def hold(self, nbytes: int, device: int = 0) -> subprocess.Popen[str]:
        proc = subprocess.Popen([str(CUPROBE), "init", "ctx", str(device), "alloc", str(nbytes), "hold", "600000"],
                                env=self.env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("alloc "):
                assert " rc=0" in line, line
            if line.startswith("holding"):
                break
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def holders(gpu: FakeGpu) -> Iterator[Holders]:
    started = Holders(gpu)
    yield started
    started.stop()


def held(reader: Nvml) -> dict[tuple[int, int], int | None]:
    return {(p.pid, p.device_index): p.used_bytes for p in reader.snapshot().processes}


@pytest.mark.parametrize("api", ["1", "2", "3"])
def test_every_entry_point_version_reads_the_same_truth(holders: Holders, monkeypatch: pytest.MonkeyPatch, api: str) -> None:
    a = holders.hold(256 * MIB)
    b = holders.hold(512 * MIB, device=1)
    monkeypatch.setenv("FAKE_NVML_PROCESS_API", api)  # an older driver: newer entry points answer FUNCTION_NOT_FOUND
    reader = Nvml(holders.nvml)
    snap = reader.snapshot()
    assert {(p.pid, p.device_index): p.used_bytes for p in snap.processes} == {(a.pid, 0): 256 * MIB + CONTEXT,
                                                                             (b.pid, 1): 512 * MIB + CONTEXT}
    assert snap.devices == (UUID0, "GPU-0100fa4e-1111-2222-3333-000000000001")
    assert snap.api == f"compute_v{api}+graphics_v{api}"


def test_struct_layouts_are_nvml_h(holders: Holders) -> None:
    a = holders.hold(64 * MIB)
    lib = ctypes.CDLL(holders.nvml)
    assert lib.nvmlInit_v2() == NVML_SUCCESS
    device = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device)) == NVML_SUCCESS
    for name, record in (("nvmlDeviceGetComputeRunningProcesses", ProcessInfoV1),
                         ("nvmlDeviceGetComputeRunningProcesses_v2", ProcessInfoV2),
                         ("nvmlDeviceGetComputeRunningProcesses_v3", ProcessInfoV2)):
        count = ctypes.c_uint(0)
        # A count query: no room, no buffer; the answer is INSUFFICIENT_SIZE and how many there are.
        assert getattr(lib, name)(device, ctypes.byref(count), None) == NVML_ERROR_INSUFFICIENT_SIZE and count.value == 1
        buffer = (record * 2)()
        count = ctypes.c_uint(2)
        assert getattr(lib, name)(device, ctypes.byref(count), buffer) == NVML_SUCCESS and count.value == 1
        assert (buffer[0].pid, buffer[0].usedGpuMemory) == (a.pid, 64 * MIB + CONTEXT)
        if record is ProcessInfoV2:
            assert (buffer[0].gpuInstanceId, buffer[0].computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)  # not MIG
    other = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(1, ctypes.byref(other)) == NVML_SUCCESS
    count = ctypes.c_uint(0)
    assert lib.nvmlDeviceGetComputeRunningProcesses_v3(other, ctypes.byref(count), None) == NVML_SUCCESS and count.value == 0


def test_a_list_longer_than_the_buffer_is_read_whole(holders: Holders) -> None:
    started = [holders.hold(MIB * (i + 1)) for i in range(20)]  # the reader starts with room for 16
    assert held(Nvml(holders.nvml)) == {(p.pid, 0): MIB * (i + 1) + CONTEXT for i, p in enumerate(started)}


def test_a_process_in_both_lists_counts_once(holders: Holders, monkeypatch: pytest.MonkeyPatch) -> None:
    a = holders.hold(128 * MIB)
    monkeypatch.setenv("FAKE_NVML_GRAPHICS", "all")  # graphics and compute contexts: listed twice, all its memory each time
    assert held(Nvml(holders.nvml)) == {(a.pid, 0): 128 * MIB + CONTEXT}


def test_dead_processes_are_dropped(holders: Holders) -> None:
    a, b = holders.hold(64 * MIB), holders.hold(32 * MIB)
    a.kill()
    a.wait()
    assert held(Nvml(holders.nvml)) == {(b.pid, 0): 32 * MIB + CONTEXT}


def test_a_withheld_figure_is_none_never_zero(holders: Holders, monkeypatch: pytest.MonkeyPatch) -> None:
    a = holders.hold(64 * MIB)
    monkeypatch.setenv("FAKE_NVML_USED", "unavailable")
    assert held(Nvml(holders.nvml)) == {(a.pid, 0): None}


def test_no_view_is_an_error_never_an_empty_list(gpu: FakeGpu) -> None:
    with pytest.raises(NvmlError, match="RunningProcesses"):
        Nvml(NO_LEDGER_NVML).snapshot()  # no ledger beside this copy: no node-wide view
    with pytest.raises(NvmlError, match="cannot load"):
        Nvml(str(FAKE_DIR / "missing" / "libnvidia-ml.so.1"))


def test_start_time_tells_a_process_apart_and_survives_odd_names(tmp_path: Path) -> None:
    odd = tmp_path / "a) b (c"
    odd.symlink_to("/bin/sleep")
    first = subprocess.Popen([str(odd), "30"])
    try:
        time.sleep(0.05)
        started = enforce.start_time(Path("/proc"), first.pid)
        assert started is not None and started == enforce.start_time(Path("/proc"), first.pid)
        found = enforce.identify(Path("/proc"), first.pid)
        assert found is not None and found[0] == enforce.Identity(first.pid, started)
    finally:
        first.kill()
        first.wait()
    assert enforce.start_time(Path("/proc"), first.pid) is None


def test_one_users_shutdown_leaves_the_others_session_open(holders: Holders) -> None:
    """nvmlInit and nvmlShutdown are reference counted, as NVML documents them: the agent's creation gate closing
    its handle must not blind the enforcer that shares the process's NVML."""
    holders.hold(64 * MIB)
    enforcer, gate = Nvml(holders.nvml), Nvml(holders.nvml)
    gate.close()
    assert held(enforcer), "the enforcer's view ended with another user's shutdown"
    enforcer.close()
    with pytest.raises(NvmlError, match="Uninitialized"):
        enforcer.snapshot()
    shutdown = ctypes.CDLL(holders.nvml).nvmlShutdown
    assert shutdown() == 1  # NVML_ERROR_UNINITIALIZED: more shutdowns than inits
