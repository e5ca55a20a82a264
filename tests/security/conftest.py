"""Fixtures for attack tests: a simulated GPU node per test (each cgroup driver), as root only."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kai_isolator.services.demo.kubelet import cgroup_hierarchies
from kai_isolator.shared.cgroups import CgroupDriver
from security.container import REPO, SimNode


@pytest.fixture(scope="session", autouse=True)
def hamicore_built() -> None:
    proc = subprocess.run(["make", "-s", "-C", str(REPO / "hami-core")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(params=[CgroupDriver.CGROUPFS, CgroupDriver.SYSTEMD], ids=["cgroupfs", "systemd"])
async def node(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SimNode]:
    """A GPU node with our library installed, a private fake-driver ledger, and the kubelet's cgroups.

    This skip is the security tests' root requirement (a `pytestmark` in a conftest would be ignored): every
    test that runs a simulated container asks for this fixture."""
    if os.geteuid() != 0:
        pytest.skip("needs root: simulated containers need mount namespaces and writable cgroup hierarchies")
    if not cgroup_hierarchies():
        pytest.skip("needs a writable cgroup hierarchy under /sys/fs/cgroup for the simulated containers (root has none here)")
    # A module may name the kind of driver its nodes have (DRIVER_BRANCH = 615: NVML 13.4's per-cgroup limits).
    sim = SimNode(tmp_path / "host", tmp_path, request.param, driver_branch=getattr(request.module, "DRIVER_BRANCH", 580))
    try:
        yield sim
    finally:
        await sim.stop()

