"""pytest fixtures on the real control plane: etcd + kube-apiserver started once per session, from the build cache.

`control_plane` has deploy/ applied (`deployed`) and per-test namespaces: the manifest and RBAC suites. `dev_cluster`
is a second plane with KAI and GPU nodes simulated through its API, emptied after every test: what the
services' integration tests run on. Registered from tests/conftest.py; nothing starts unless a test asks.
"""

from __future__ import annotations

import atexit
import itertools
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kai_isolator.services.devcluster.build import Binaries, BuildError, ensure_all
from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.plane import ControlPlane, ControlPlaneError
from kai_isolator.shared.embedded_nats import EmbeddedNats
import run_summary
from support import build_before_tests

from .node import GpuNode
from .webhook import NAMESPACE, RunningWebhook, run_certs

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "kustomize" / "base"
_names = itertools.count()
_built: list[Binaries | BuildError] = []


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    built = build_before_tests(config, items, {"control_plane", "dev_plane"}, lambda: ensure_all(sys.stderr), BuildError)
    if built is not None:
        _built.append(built)


def _session_plane(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[ControlPlane]:
    binaries = _built[0] if _built else ensure_all(sys.stderr)
    if isinstance(binaries, BuildError):
        raise ControlPlaneError(f"the control plane could not be built: {binaries}")
    plane = ControlPlane(binaries, tmp_path_factory.mktemp(name))
    atexit.register(plane.stop)  # also when the session ends without teardown (an interrupt during setup)
    started = time.monotonic()
    plane.start()
    plane.startup_s["total"] = time.monotonic() - started
    times = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in plane.startup_s.items())
    run_summary.add("real control planes", f"{name} (kube-apiserver {binaries.kube_version}, etcd {binaries.etcd_version}) "
                                           f"started in: {times}")
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver (Node,RBAC; default admission plugins), from the build cache."""
    yield from _session_plane(tmp_path_factory, "control-plane")


@pytest.fixture(scope="session")
def dev_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """The plane under `dev_cluster`: apart from `control_plane`, whose deploy/ webhook would judge every pod."""
    yield from _session_plane(tmp_path_factory, "dev-plane")


@pytest.fixture
def dev_cluster_options() -> dict[str, Any]:
    """Override in a test module to change the simulated nodes or their pace."""
    return {"nodes": {"gpu-node-1": 15360}, "step_s": 0.02}


@pytest.fixture
async def dev_cluster(dev_plane: ControlPlane, dev_cluster_options: dict[str, Any], tmp_path: Path) -> AsyncIterator[DevCluster]:
    """The real API server with KAI's admission, scheduler and the GPU nodes' kubelets simulated; emptied afterwards."""
    options = {**dev_cluster_options, "nodes": dict(dev_cluster_options.get("nodes", {"gpu-node-1": 15360}))}
    async with DevCluster(plane=dev_plane, workdir=tmp_path / "devcluster", **options) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def deployed(control_plane: ControlPlane) -> list[dict[str, Any]]:
    """deploy/kustomize/base applied as a user applies it (`kubectl apply -k`); the objects it holds."""
    control_plane.kubectl("apply", "-k", str(BASE))
    return [d for d in yaml.safe_load_all(control_plane.kubectl("kustomize", str(BASE)).stdout) if d]


def unique_name(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


def make_namespace(plane: ControlPlane, prefix: str = "test", labels: dict[str, str] | None = None) -> str:
    """A fresh namespace with its `default` ServiceAccount (which the controller-manager, absent here, would create)."""
    name = unique_name(prefix)
    plane.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": name, "labels": labels or {}}})
    plane.request("POST", f"/api/v1/namespaces/{name}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                                         "metadata": {"name": "default"}})
    return name


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    return make_namespace(control_plane)


@pytest.fixture(scope="session")
def gpu_node(control_plane: ControlPlane) -> GpuNode:
    """One simulated T4 (15360 MiB), registered by its own kubelet identity."""
    return GpuNode(control_plane, "gpu-node-1", 15360)


@pytest.fixture(scope="session")
def certs_output(control_plane: ControlPlane, deployed: list[dict[str, Any]]) -> str:
    """The certs Job's one-shot, run once under the Job's ServiceAccount and RBAC."""
    done = run_certs(control_plane, control_plane.service_account_kubeconfig(NAMESPACE, "kai-resource-isolator-certs"))
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


@pytest.fixture
def webhook(control_plane: ControlPlane, certs_output: str, nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[RunningWebhook]:
    """Our webhook as deploy/ runs it, behind the Service deploy/ registers (failurePolicy Fail: stopped, it refuses)."""
    running = RunningWebhook(control_plane, tmp_path, nats_server.url).start()
    yield running
    running.stop()
