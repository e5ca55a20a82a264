"""The fake GPU's ledger process at its edges: malformed requests, devices it does not have, a card too small or
too large, a driver that is not built, what is left behind when it stops, and the driver branch a node's ledger
is started as (R580, or R615 with NVML 13.4's per-cgroup limits: tests/unit/devcluster/test_fake_gpu_ledger_limits.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kai_isolator.services.devcluster import fake_gpu_ledger as fake_gpu
from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu, FakeGpuError

HAMI = Path(__file__).resolve().parents[3] / "hami-core"


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def answer(gpu: FakeGpu, message: bytes) -> tuple[int, ...]:
    """The ledger's reply to one message: status, count, v[0..4]."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as link:
        link.settimeout(10)
        link.connect(str(gpu.socket))
        link.send(message)
        return fake_gpu.REPLY.unpack_from(link.recv(4096))


def ask(gpu: FakeGpu, message: bytes) -> int:
    return answer(gpu, message)[0]


def test_malformed_and_out_of_range_requests_get_an_error_and_change_nothing(tmp_path: Path) -> None:
    with FakeGpu(tmp_path / "driver", devices=2, total_mib=1024) as gpu:
        request = fake_gpu.REQUEST
        assert ask(gpu, b"\x02" * 7) == fake_gpu.CUDA_ERROR_INVALID_VALUE  # too short
        assert ask(gpu, request.pack(fake_gpu.OP_ALLOC, 0, 1, 0) + b"x") == fake_gpu.CUDA_ERROR_INVALID_VALUE  # too long
        assert ask(gpu, request.pack(99, 0, 0, 0)) == fake_gpu.CUDA_ERROR_INVALID_VALUE  # no such operation
        assert ask(gpu, request.pack(fake_gpu.OP_ALLOC, 2, 1, 0)) == fake_gpu.CUDA_ERROR_INVALID_DEVICE  # a third device
        assert ask(gpu, request.pack(fake_gpu.OP_ALLOC, -1, 1, 0)) == fake_gpu.CUDA_ERROR_INVALID_DEVICE
        assert ask(gpu, request.pack(fake_gpu.OP_ALLOC, 0, 0, 0)) == fake_gpu.CUDA_ERROR_INVALID_VALUE  # nothing
        assert ask(gpu, request.pack(fake_gpu.OP_ALLOC, 0, -1, 0)) == fake_gpu.CUDA_ERROR_OUT_OF_MEMORY  # 2**64 - 1 bytes
        assert ask(gpu, request.pack(fake_gpu.OP_LIMIT, 0, 7, 1)) == fake_gpu.CUDA_ERROR_INVALID_VALUE  # no such limit
        assert ask(gpu, request.pack(fake_gpu.OP_IMPORT_TOKEN, 0, 1, 2)) == fake_gpu.CUDA_ERROR_INVALID_HANDLE  # a guessed token
        assert ask(gpu, request.pack(fake_gpu.OP_IMPORT_FD, 0, 0, 0)) == fake_gpu.CUDA_ERROR_INVALID_HANDLE  # no fd at all
        assert gpu.stats(0) == gpu.stats(1) == {"used": 0, "peak": 0, "allocs": 0, "frees": 0, "reserved": 0, "total": 1024 << 20}
        assert gpu.processes(0) == {}
        with pytest.raises(FakeGpuError, match="answered 101"):
            gpu.stats(5)
    assert not gpu.socket.exists()  # stopped, it leaves no socket for a library to find


def test_a_card_it_cannot_be_is_refused_at_start(tmp_path: Path) -> None:
    for devices, mib in ((0, 1024), (17, 1024), (1, 0)):
        done = subprocess.run([sys.executable, "-m", "kai_isolator.services.devcluster.fake_gpu_ledger", f"--socket={tmp_path / 's'}",
                               f"--devices={devices}", f"--total-mib={mib}"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and "a fake GPU needs 1..16 devices" in done.stderr
    with pytest.raises(FakeGpuError, match="did not start"):
        FakeGpu(tmp_path / "driver", devices=0).start(timeout_s=10)


def test_a_driver_that_is_not_built_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FakeGpuError, match="the fake driver is not built"):
        FakeGpu(tmp_path / "driver", build=tmp_path / "nowhere").start()


def test_a_work_dir_longer_than_a_socket_path_still_holds_the_gpu(tmp_path: Path) -> None:
    """A node's driver folder under a test's tmp_path easily passes the 108 bytes a socket path may have (the
    demo's did): the ledger binds, and the fake libraries reach it, through the folder's descriptor."""
    folder = tmp_path / ("a-node-work-dir-" + "x" * 60) / "host-gpu-node-1" / "usr" / "lib" / "nvidia-driver"
    assert len(str(folder / fake_gpu.SOCKET_NAME)) > 108
    with FakeGpu(folder, total_mib=1024) as gpu:
        assert gpu.stats()["total"] == 1024 << 20
        cuda = subprocess.run([sys.executable, "-c", (
            "import ctypes, sys\n"
            f"cu = ctypes.CDLL({str(gpu.folder / 'libcuda.so.1')!r})\n"
            "total = ctypes.c_size_t()\n"
            "assert cu.cuInit(0) == 0, 'cuInit'\n"
            "assert cu.cuDeviceTotalMem_v2(ctypes.byref(total), 0) == 0\n"
            "print(total.value)\n")], capture_output=True, text=True, timeout=30, check=False)
        assert cuda.returncode == 0, cuda.stderr
        assert int(cuda.stdout) == 1024 << 20  # the ledger's card, not the in-process default


def test_the_driver_branch_is_the_nodes_and_says_what_it_has(tmp_path: Path) -> None:
    request = fake_gpu.REQUEST
    assert "--driver-branch=580" in FakeGpu(tmp_path / "default").command()  # a node is R580 unless started otherwise
    for branch, version, cuda in ((580, (580, 65 << 16 | 6), 13000), (615, (615, 71 << 16 | 9), 13040)):
        with FakeGpu(tmp_path / f"r{branch}", total_mib=1024, driver_branch=branch) as gpu:
            # HELLO keeps its first two values where every older client reads them, and adds the driver's.
            assert answer(gpu, request.pack(fake_gpu.OP_HELLO, 0, 0, 0))[2:] == (1, 1024 << 20, *version, cuda)
            assert ask(gpu, request.pack(fake_gpu.OP_ALLOC, 0, 1 << 20, 0)) == fake_gpu.CUDA_SUCCESS  # as clients ask today
            assert ask(gpu, request.pack(fake_gpu.OP_ALLOC, 0, 1 << 20, 2)) == fake_gpu.CUDA_ERROR_INVALID_VALUE  # no such flag
            assert ask(gpu, request.pack(fake_gpu.OP_MEMINFO, 1, 0, 0)) == fake_gpu.CUDA_ERROR_INVALID_DEVICE
            assert answer(gpu, request.pack(fake_gpu.OP_MEMINFO, 0, 0, 0))[2:5] == (1024 << 20, 1024 << 20, 0)  # the link closed
            # A limit request that names no cgroup (no directory's descriptor came with it).
            set_limits = ask(gpu, request.pack(fake_gpu.OP_SET_LIMITS, 0, 0, 1 << 20))
            get_limits = ask(gpu, request.pack(fake_gpu.OP_GET_LIMITS, 0, 0, 0))
            if branch == 580:
                assert set_limits == get_limits == fake_gpu.NVML_ERROR_NOT_SUPPORTED
            else:
                assert set_limits == (fake_gpu.NVML_ERROR_OPERATING_SYSTEM if os.geteuid() == 0 else fake_gpu.NVML_ERROR_NO_PERMISSION)
                assert get_limits == fake_gpu.NVML_ERROR_OPERATING_SYSTEM
                assert ask(gpu, request.pack(fake_gpu.OP_GET_LIMITS, 1, 0, 0)) == fake_gpu.NVML_ERROR_INVALID_ARGUMENT
    done = subprocess.run([sys.executable, "-m", "kai_isolator.services.devcluster.fake_gpu_ledger", f"--socket={tmp_path / 's'}", "--driver-branch=600"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "the fake driver is branch 580 or 615, not 600" in done.stderr
