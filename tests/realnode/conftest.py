"""pytest fixtures on a real node: the control plane plus controller-manager, scheduler, kubelet, containerd and runc.

`real_node` starts one `RealNodeCluster` per session (in a thread with its own event loop, so any test, sync or
async, can use it through kubectl); `cuda_image` is the stand-in for the seed's `nvidia/cuda` image, imported into
the node's containerd. Pods each test makes are deleted after it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_isolator.services.devcluster.build import BuildError, ensure_node
from kai_isolator.services.devcluster.oci import image_archive, with_libraries
from kai_isolator.services.devcluster.realcluster import RealNodeCluster
from real_node_support import CUDA_IMAGE, HAMI_BUILD, LoopThread, Node
from support import build_before_tests

START_TIMEOUT_S = 300.0
_built: list[object] = []


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the node's programs before any test runs, as the control plane's are."""
    built = build_before_tests(config, items, {"real_node"}, lambda: ensure_node(sys.stderr), BuildError)
    if built is not None:
        _built.append(built)


@pytest.fixture(scope="session")
def real_node_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    if _built and isinstance(_built[0], BuildError):
        raise _built[0]
    loop = LoopThread()
    real = RealNodeCluster(workdir=tmp_path_factory.mktemp("real-node"))
    try:
        loop.run(real.start(), START_TIMEOUT_S)
        phases = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in real.startup_s.items())
        print(f"\nreal node ready: {phases}", file=sys.stderr, flush=True)
        yield Node(real, loop)
    finally:
        with contextlib.suppress(Exception):
            loop.run(real.stop(), 120)
        loop.close()


@pytest.fixture
def real_node(real_node_session: Node) -> Iterator[Node]:
    """The session's real node; the pods a test applied through it are gone after the test."""
    try:
        yield real_node_session
    finally:
        real_node_session.clean()


@pytest.fixture(scope="session")
def cuda_image(real_node_session: Node, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A stand-in of `nvidia/cuda:12.9.2-base-ubuntu24.04` (no registry is reachable): this machine's shell and core
    tools with their libraries, a CUDA program (`cuprobe`), and the CUDA base image's environment; no driver, which
    the `nvidia` runtime adds, as on a GPU node."""
    tools = {f"/usr/bin/{name}": Path(f"/usr/bin/{name}") for name in ("cat", "sleep", "grep", "id", "env", "ls", "head")}
    files = {"/bin/sh": Path("/bin/dash"), **tools, "/usr/local/bin/cuprobe": HAMI_BUILD / "tests" / "cuprobe",
             "/usr/local/bin/rawelf": HAMI_BUILD / "tests" / "rawelf",
             # glibc's compatibility stubs, which Ubuntu 24.04 (the real image) has: a libvgpu.so built on an older glibc,
             # as the node agent's image builds it, names them.
             **{f"/lib/x86_64-linux-gnu/{stub}": Path(f"/lib/x86_64-linux-gnu/{stub}") for stub in ("libdl.so.2", "libpthread.so.0")}}
    archive = image_archive(CUDA_IMAGE, with_libraries(files, provided=("libcuda.so.1", "libnvidia-ml.so.1")),
                            tmp_path_factory.mktemp("images") / "cuda.tar", command=["/bin/sh"],
                            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES": "all",
                                 "NVIDIA_DRIVER_CAPABILITIES": "compute,utility", "CUDA_VERSION": "12.9.2"})
    real_node_session.node.import_image(archive)
    return CUDA_IMAGE
