"""The real KAI-Scheduler's admission on a control plane of its own, for the tests of this folder: one plane and one
seed-configured admission per session (KAI's configurations would judge every pod of a shared plane)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_isolator.services.devcluster.build import _unpack, kai_source
from kai_isolator.services.devcluster.kai import GPU_MEMORY_LABEL, KAI_NAMESPACE
from kai_isolator.services.devcluster.plane import ControlPlane
from kai.real_kai import TENANT, RealKaiAdmission, RealKaiScheduling, ensure_namespace, ensure_runtime_class, real_admission
from support.control_plane import _session_plane

T4_NODE = "gpu-node-1"
TWO_GPU_NODE = "two-t4s"
# A T4, a 16384 MiB card (where PR #2041 changes the rounding), a node without the memory label (PR #2157), and a node
# with two T4s (gpu-fraction-num-devices).
NODES = {T4_NODE: {GPU_MEMORY_LABEL: "15360"}, "card-16384": {GPU_MEMORY_LABEL: "16384"}, "unlabelled": {},
         TWO_GPU_NODE: {GPU_MEMORY_LABEL: "15360", "nvidia.com/gpu.count": "2"}}


@pytest.fixture(scope="session")
def kai_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    for plane in _session_plane(tmp_path_factory, "kai-plane"):
        for namespace in (TENANT, KAI_NAMESPACE):
            ensure_namespace(plane, namespace)
        for runtime_class in ("nvidia", "custom"):
            ensure_runtime_class(plane, runtime_class)
        yield plane


@pytest.fixture(scope="session")
def seed_kai(kai_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealKaiAdmission]:
    """KAI's admission as the seed installs it (gpuSharing, hamicore)."""
    yield from real_admission(kai_plane, tmp_path_factory.mktemp("kai-seed"), hamicore=True)


@pytest.fixture(scope="session")
def kai_source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """KAI's source tree, unpacked from its archive: its CRDs are what its chart installs."""
    return _unpack(kai_source(), tmp_path_factory.mktemp("kai-source"))


@pytest.fixture(scope="session")
def kai_scheduling(kai_plane: ControlPlane, seed_kai: RealKaiAdmission, kai_source_tree: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealKaiScheduling]:
    """KAI's podgrouper, scheduler and binder (seed flags) beside the seed admission, and the simulated nodes of NODES."""
    scheduling = RealKaiScheduling(kai_plane, tmp_path_factory.mktemp("kai-scheduling"), kai_source_tree)
    scheduling.install([TENANT])
    for name, labels in NODES.items():
        scheduling.add_node(name, labels)
    scheduling.start()
    try:
        yield scheduling
    finally:
        scheduling.stop()
