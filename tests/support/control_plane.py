"""The tests' real Kubernetes control plane: etcd and kube-apiserver built from pinned Go modules, started per session,
and KAI-Scheduler and a GPU node's kubelet played step by step on it.

`control_plane` has deploy/ applied (`deployed`) and per-test namespaces: the manifest and RBAC suites. `dev_cluster`
is a second plane with KAI and GPU nodes simulated through its API, emptied after every test: what the
services' integration tests run on. Registered from tests/conftest.py; nothing starts unless a test asks.

`kai_bind`, `GpuNode` and `Cluster` are KAI's binder and the kubelet under the test's control: the binder does what
KAI's binder does (the limit into the pod's shared-GPU ConfigMap, then the `binding` subresource); the node is a kubelet
to the API server (system:node:<name>, so the Node authorizer decides what it may write) and reports status through the
`status` subresource. KAI's model is the local control plane's (services/devcluster/kai.py), the one place the project
spells KAI's arithmetic.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kai_isolator.services.devcluster.build import Binaries, BuildError, ensure_all
from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.kai import (
    GPU_MEMORY_LABEL, HOSTNAME_LABEL, RESERVATION_SETUP, gpu_group_labels, limit_configmap, num_devices, reservation_pod,
)
from kai_isolator.services.devcluster.kubelet import finished_status, running_status
from kai_isolator.services.devcluster.plane import ApiCallError, ApiClient, ControlPlane, ControlPlaneError
from kai_isolator.shared.contract import RESERVATION_NAMESPACE
from kai_isolator.shared.embedded_nats import EmbeddedNats
from support import REPO, run_summary
from support.building import build_before_tests
from support.pods import make_namespace
from support.webhook import NAMESPACE, RunningWebhook, run_certs

BASE = REPO / "deploy" / "kustomize" / "base"
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


# --- KAI's binder and the kubelet, step by step ----------------------------------------------------------------------

def kai_bind(plane: ControlPlane, pod: dict[str, Any], node: str, gpu_memory_mib: int) -> None:
    """KAI's binder: the GPU reserved (its reservation pod, the group label on the pod), PreBind writes
    CUDA_DEVICE_MEMORY_LIMIT into the pod's ConfigMap, then the pod is bound. A share goes on the node's first GPU(s)."""
    meta = pod["metadata"]
    configmap = limit_configmap(pod, gpu_memory_mib)
    if configmap is not None:
        gpus = list(range(num_devices(meta.get("annotations") or {})))
        for path, setup in RESERVATION_SETUP:
            with contextlib.suppress(ApiCallError):  # made once
                plane.request("POST", path, setup)
        for gpu in gpus:
            try:
                plane.request("POST", f"/api/v1/namespaces/{RESERVATION_NAMESPACE}/pods", reservation_pod(node, gpu))
            except ApiCallError as error:
                if error.code != 409:  # made before, for an earlier share of the GPU
                    raise
        plane.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", {"metadata": {"labels": gpu_group_labels(node, gpus)}},
                      content_type="application/merge-patch+json")
        plane.request("POST", f"/api/v1/namespaces/{meta['namespace']}/configmaps", configmap)
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
               "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    plane.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", binding)


class GpuNode:
    """A node that registers itself and reports its pods' status, with a kubelet's own credentials."""

    def __init__(self, plane: ControlPlane, name: str, gpu_memory_mib: int = 15360) -> None:
        self.name = name
        self.gpu_memory_mib = gpu_memory_mib
        self.api: ApiClient = plane.node_client(name)
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {HOSTNAME_LABEL: name, GPU_MEMORY_LABEL: str(gpu_memory_mib), "nvidia.com/gpu.count": "1"}},
                "status": {"capacity": {"cpu": "16", "memory": "128Gi", "pods": "110", "nvidia.com/gpu": "1"}}}
        self.api.request("POST", "/api/v1/nodes", node)
        # The GPU Operator's runtime class, which KAI's admission gives every GPU-sharing pod.
        try:
            plane.request("POST", "/apis/node.k8s.io/v1/runtimeclasses",
                          {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"}, "handler": "nvidia"})
        except ApiCallError as error:
            if error.code != 409:
                raise

    def _status(self, pod: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        path = f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}/status"
        return self.api.request("PATCH", path, {"status": status}, content_type="application/strategic-merge-patch+json")

    def run(self, pod: dict[str, Any]) -> dict[str, Any]:
        return self._status(pod, running_status(pod))

    def finish(self, pod: dict[str, Any], exit_code: int = 0) -> dict[str, Any]:
        current = self.api.request("GET", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}")
        return self._status(current, finished_status(current, exit_code))


# Where our webhook is not running: the namespace opts out, and pods arrive already injected.
NO_WEBHOOK = {"kai-resource-isolator.io/webhook": "ignore"}


class Cluster:
    """The calls the tests make as KAI (create, bind) and as the node (status), on one namespace."""

    def __init__(self, plane: ControlPlane, node: GpuNode, namespace: str) -> None:
        self.plane, self.node, self.namespace = plane, node, namespace

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.plane.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", body)

    def get(self, name: str) -> dict[str, Any]:
        return self.plane.request("GET", f"/api/v1/namespaces/{self.namespace}/pods/{name}")

    def start(self, name: str) -> dict[str, Any]:
        kai_bind(self.plane, self.get(name), self.node.name, self.node.gpu_memory_mib)
        return self.node.run(self.get(name))

    def delete(self, name: str) -> None:
        # No kubelet confirms a graceful deletion here: delete at once, as the kubelet would after its grace period.
        self.plane.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}?gracePeriodSeconds=0")
