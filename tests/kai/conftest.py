"""The real KAI-Scheduler's admission on a control plane of its own, for the tests of this folder: one plane and one
seed-configured admission per session (KAI's configurations would judge every pod of a shared plane)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from control_plane.fixtures import _session_plane
from kai_isolator.services.devcluster.kai import KAI_NAMESPACE
from kai_isolator.services.devcluster.plane import ControlPlane
from kai.real_kai import TENANT, RealKaiAdmission, ensure_namespace, ensure_runtime_class, real_admission


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
