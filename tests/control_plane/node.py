"""KAI-Scheduler and the kubelet, step by step under the test's control, on the real API server.

The binder does what KAI's binder does (the limit into the pod's shared-GPU ConfigMap, then the `binding`
subresource); the node is a kubelet to the API server (system:node:<name>, so the Node authorizer decides what
it may write) and reports status through the `status` subresource. KAI's model is the local control plane's
(services/devcluster/kai.py), the one place the project spells KAI's arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Any

from kai_isolator.services.devcluster.kai import (
    GPU_MEMORY_LABEL, HOSTNAME_LABEL, RESERVATION_SETUP, gpu_group_labels, kai_admit, limit_configmap, num_devices, reservation_pod,
)
from kai_isolator.shared.contract import RESERVATION_NAMESPACE
from kai_isolator.services.devcluster.kubelet import finished_status, running_status
from kai_isolator.services.devcluster.plane import ApiCallError, ApiClient, ControlPlane


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


def gpu_pod(name: str, *, injected: bool = True, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "busybox"}
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": {"gpu-memory": "4096", **(annotations or {})}},
                           "spec": {"schedulerName": "kai-scheduler", "containers": [container]}}
    if injected:
        pod["spec"]["volumes"] = [{"name": "kai-resource-isolator-vgpu", "hostPath": {"path": "/usr/local/vgpu", "type": "Directory"}}]
        container["volumeMounts"] = [{"name": "kai-resource-isolator-vgpu", "mountPath": "/etc/ld.so.preload", "subPath": "ld.so.preload",
                                      "readOnly": True}]
    return kai_admit(pod)  # KAI's own admission: the limit env from the ConfigMap its binder will write


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
