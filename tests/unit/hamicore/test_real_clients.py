"""The CUDA and NVML clients people run in GPU containers, from PyPI and unpatched, run under
libvgpu.so on the fake driver: each sees the grant as the card, allocates up to it and gets its own
out-of-memory error past it; and each, run without the library, sees and takes the whole card (so
these tests fail if the library does nothing)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from vgpu_harness import MIB, node_gpu, run_program

CARD_MIB = 15360  # the fake's card
GRANT = "4147m"  # the seed's grant on a T4
GRANT_MIB = 4147


def client(script: str, env: dict[str, str], tmp_path: Path, preload: bool = True, devices: int = 1) -> dict:
    """Run `script` in a fresh interpreter on a private node-wide fake GPU of `devices`; its last line is JSON."""
    with node_gpu(tmp_path / "node-gpu", devices=devices) as node:
        result = run_program([sys.executable, "-c", textwrap.dedent(script)], {**node, **env}, preload=preload, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.lines[-1])


PYNVML = """
    import json, pynvml
    pynvml.nvmlInit()
    memory = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
    print(json.dumps([[m.total >> 20, m.free >> 20, m.used >> 20] for m in memory]))
"""


def test_pynvml_sees_the_grant_and_without_the_library_the_card(tmp_path: Path) -> None:
    assert client(PYNVML, {"CUDA_DEVICE_MEMORY_LIMIT": GRANT}, tmp_path) == [[GRANT_MIB, GRANT_MIB, 0]]
    assert client(PYNVML, {}, tmp_path, preload=False) == [[CARD_MIB, CARD_MIB, 0]]


def test_pynvml_per_device_limits(tmp_path: Path) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT_0": "1g", "CUDA_DEVICE_MEMORY_LIMIT_1": "2048m"}
    assert client(PYNVML, env, tmp_path, devices=2) == [[1024, 1024, 0], [2048, 2048, 0]]


def test_gpustat_shows_the_grant(tmp_path: Path) -> None:
    script = """
        import json, subprocess, sys
        out = subprocess.run([sys.executable, "-m", "gpustat", "--json", "--no-processes"], capture_output=True, text=True, check=True).stdout
        print(json.dumps([g["memory.total"] for g in json.loads(out)["gpus"]]))
    """
    assert client(script, {"CUDA_DEVICE_MEMORY_LIMIT": GRANT}, tmp_path) == [GRANT_MIB]
    assert client(script, {}, tmp_path, preload=False) == [CARD_MIB]


# cuda.bindings: the driver API as NVIDIA's own Python binding calls it (through cuGetProcAddress).
BINDINGS = """
    import json, os
    from cuda.bindings import driver as cu
    def ok(result):
        rc, *value = result if isinstance(result, tuple) else (result,)
        return rc == cu.CUresult.CUDA_SUCCESS, (value[0] if value else None), rc.name
    cu.cuInit(0)
    device = int(os.environ.get("DEVICE", "0"))
    _, dev, _ = ok(cu.cuDeviceGet(device))
    _, ctx, _ = ok(cu.cuDevicePrimaryCtxRetain(dev))
    cu.cuCtxSetCurrent(ctx)
    rc, free, total = cu.cuMemGetInfo()
    first = ok(cu.cuMemAlloc(int(os.environ["FIRST"])))
    second = ok(cu.cuMemAlloc(int(os.environ["SECOND"])))
    print(json.dumps({"total_mib": total >> 20, "first": first[2], "second": second[2]}))
"""


def test_cuda_bindings_allocate_up_to_the_grant_and_not_a_mib_more(tmp_path: Path) -> None:
    sizes = {"FIRST": str(GRANT_MIB * MIB - MIB), "SECOND": str(2 * MIB)}
    held = client(BINDINGS, {"CUDA_DEVICE_MEMORY_LIMIT": GRANT, **sizes}, tmp_path)
    assert held == {"total_mib": GRANT_MIB, "first": "CUDA_SUCCESS", "second": "CUDA_ERROR_OUT_OF_MEMORY"}
    exact = client(BINDINGS, {"CUDA_DEVICE_MEMORY_LIMIT": GRANT, "FIRST": str(GRANT_MIB * MIB - MIB), "SECOND": str(MIB)}, tmp_path)
    assert exact["second"] == "CUDA_SUCCESS"  # exactly the grant
    whole = client(BINDINGS, sizes | {"SECOND": str(8 * 1024 * MIB)}, tmp_path, preload=False)
    assert whole == {"total_mib": CARD_MIB, "first": "CUDA_SUCCESS", "second": "CUDA_SUCCESS"}


def test_cuda_bindings_per_device_limits(tmp_path: Path) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT_0": "1g", "CUDA_DEVICE_MEMORY_LIMIT_1": "2048m", "DEVICE": "1",
           "FIRST": str(2048 * MIB), "SECOND": str(MIB)}
    assert client(BINDINGS, env, tmp_path, devices=2) == {"total_mib": 2048, "first": "CUDA_SUCCESS", "second": "CUDA_ERROR_OUT_OF_MEMORY"}


def test_cuda_bindings_fail_closed_on_a_garbage_limit(tmp_path: Path) -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "4.5g", "FIRST": str(MIB), "SECOND": str(MIB)}
    with node_gpu(tmp_path / "node-gpu") as node:
        result = run_program([sys.executable, "-c", textwrap.dedent(BINDINGS)], {**node, **env}, timeout=120)
    assert json.loads(result.lines[-1])["first"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert result.stderr.count('CUDA_DEVICE_MEMORY_LIMIT="4.5g" is not a size') == 1


def test_a_forked_child_is_held_to_the_same_ledger(tmp_path: Path) -> None:
    # Forked before either touches CUDA (a child cannot use its parent's), both then allocate:
    # 3 GiB in the parent leave the child no room for 2 GiB under one 4147m grant.
    script = """
        import json, os
        from cuda.bindings import driver as cu
        def alloc(size):
            cu.cuInit(0)
            _, dev = cu.cuDeviceGet(0)
            _, ctx = cu.cuDevicePrimaryCtxRetain(dev)
            cu.cuCtxSetCurrent(ctx)
            return cu.cuMemAlloc(size)[0].name
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        child = os.fork()
        if child == 0:
            os.read(go_r, 1)
            os.write(done_w, alloc(2 << 30).encode())
            os._exit(0)
        parent = alloc(3 << 30)
        os.write(go_w, b"x")
        print(json.dumps({"parent": parent, "child": os.read(done_r, 64).decode()}))
        os.waitpid(child, 0)
    """
    assert client(script, {"CUDA_DEVICE_MEMORY_LIMIT": GRANT}, tmp_path) == {"parent": "CUDA_SUCCESS", "child": "CUDA_ERROR_OUT_OF_MEMORY"}
    assert client(script, {}, tmp_path, preload=False) == {"parent": "CUDA_SUCCESS", "child": "CUDA_SUCCESS"}


NUMBA = """
    import json, os
    import numpy as np
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError
    free, total = cuda.current_context().get_memory_info()
    kept = cuda.device_array(int(os.environ["FIRST"]), dtype=np.uint8)
    try:
        more = cuda.device_array(int(os.environ["SECOND"]), dtype=np.uint8)
        second = "allocated"
    except CudaAPIError as error:
        second = getattr(error.code, "name", str(error.code))
    print(json.dumps({"total_mib": total >> 20, "second": second}))
"""


def test_numba_device_arrays_stop_at_the_grant_with_its_own_error(tmp_path: Path) -> None:
    sizes = {"FIRST": str(GRANT_MIB * MIB), "SECOND": str(MIB)}
    assert client(NUMBA, {"CUDA_DEVICE_MEMORY_LIMIT": GRANT, **sizes}, tmp_path) == {"total_mib": GRANT_MIB, "second": "CUDA_ERROR_OUT_OF_MEMORY"}
    assert client(NUMBA, sizes, tmp_path, preload=False) == {"total_mib": CARD_MIB, "second": "allocated"}


CUDA_CORE = """
    import json, os
    from cuda.core import Device
    from cuda.core._utils.cuda_utils import CUDAError
    device = Device(0)
    device.set_current()
    stream = device.create_stream()
    kept = device.allocate(int(os.environ["FIRST"]), stream=stream)
    try:
        device.allocate(int(os.environ["SECOND"]), stream=stream)
        second = "allocated"
    except CUDAError as error:
        second = str(error).split(":")[0]
    print(json.dumps({"first": kept.size, "second": second}))
"""


def test_cuda_core_allocations_stop_at_the_grant_with_its_own_error(tmp_path: Path) -> None:
    sizes = {"FIRST": str(GRANT_MIB * MIB), "SECOND": str(MIB)}
    assert client(CUDA_CORE, {"CUDA_DEVICE_MEMORY_LIMIT": GRANT, **sizes}, tmp_path) == {"first": GRANT_MIB * MIB, "second": "CUDA_ERROR_OUT_OF_MEMORY"}
    assert client(CUDA_CORE, sizes, tmp_path, preload=False)["second"] == "allocated"
