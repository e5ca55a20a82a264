"""What stands in for KAI-Scheduler and the kubelet on the real API server: a binder and a node that reports pod status.

The binder does what KAI's binder does (the limit into the pod's shared-GPU ConfigMap, then the `binding`
subresource); the node is a kubelet to the API server (system:node:<name>, so the Node authorizer decides what
it may write) and reports status through the `status` subresource. Both reuse the sandbox's model of KAI
(`fraction_container`, `kai_memory_limit`), the one place the project spells KAI's arithmetic.
"""

from __future__ import annotations

import datetime
import secrets
from typing import Any

from control_plane.cluster import ApiClient, ControlPlane
from kai_isolator.services.sandbox.nodesim import (
    CONFIGMAP_ANNOTATION, DEVICES_ENV, GPU_MEMORY_LABEL, HOSTNAME_LABEL, LIMIT_ENV, fake_gpu_uuid, fraction_container,
    kai_memory_limit, scheduler_portion,
)



def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def kai_admit(pod: dict[str, Any]) -> dict[str, Any]:
    """What KAI's own admission adds to a GPU-sharing pod: the shared-GPU ConfigMap's name, and env read from it."""
    target = fraction_container(pod)
    if target is None:
        raise ValueError("a GPU-sharing pod needs the container KAI targets")
    container, index = target
    annotations = pod["metadata"].setdefault("annotations", {})
    prefix = annotations.setdefault(CONFIGMAP_ANNOTATION, f"{pod['metadata']['name'][:40]}-{secrets.token_hex(3)}-shared-gpu")
    container["env"] = [*(container.get("env") or []),
                        {"name": LIMIT_ENV, "valueFrom": {"configMapKeyRef": {"name": f"{prefix}-{index}", "key": LIMIT_ENV, "optional": True}}},
                        {"name": DEVICES_ENV, "valueFrom": {"configMapKeyRef": {"name": f"{prefix}-{index}", "key": DEVICES_ENV}}}]
    return pod


def kai_bind(plane: ControlPlane, pod: dict[str, Any], node: str, gpu_memory_mib: int) -> None:
    """KAI's binder: PreBind writes CUDA_DEVICE_MEMORY_LIMIT into the pod's ConfigMap, then the pod is bound."""
    meta = pod["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    annotations = meta.get("annotations") or {}
    target = fraction_container(pod)
    if CONFIGMAP_ANNOTATION in annotations and target is not None:
        data = {"GPU_PORTION": scheduler_portion(annotations, gpu_memory_mib) or "0.00", DEVICES_ENV: fake_gpu_uuid(0)}
        limit = kai_memory_limit(annotations, gpu_memory_mib)
        if limit is not None:
            data[LIMIT_ENV] = limit
        configmap = {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
                     "metadata": {"name": f"{annotations[CONFIGMAP_ANNOTATION]}-{target[1]}",
                                  "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": meta["uid"]}]}}
        plane.request("POST", f"/api/v1/namespaces/{namespace}/configmaps", configmap)
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
               "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    plane.request("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/binding", binding)


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

    def _status(self, pod: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        path = f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}/status"
        return self.api.request("PATCH", path, {"status": status}, content_type="application/strategic-merge-patch+json")

    def run(self, pod: dict[str, Any]) -> dict[str, Any]:
        started = _now()
        statuses = [{"name": c["name"], "ready": True, "started": True, "restartCount": 0, "image": c["image"],
                     "imageID": f"test://{c['image']}", "containerID": f"containerd://{pod['metadata']['uid'].replace('-', '')}{i:02d}",
                     "state": {"running": {"startedAt": started}}} for i, c in enumerate(pod["spec"]["containers"])]
        conditions = [{"type": t, "status": "True", "lastTransitionTime": started} for t in ("Initialized", "ContainersReady", "Ready")]
        return self._status(pod, {"phase": "Running", "startTime": started, "hostIP": "10.0.0.10", "podIP": "10.244.0.10",
                                  "conditions": conditions, "containerStatuses": statuses})

    def finish(self, pod: dict[str, Any], exit_code: int = 0) -> dict[str, Any]:
        current = self.api.request("GET", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}")
        finished = _now()
        statuses = []
        for status in current["status"].get("containerStatuses") or []:
            started = (status.get("state", {}).get("running") or {}).get("startedAt", finished)
            terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "startedAt": started, "finishedAt": finished}
            statuses.append({**status, "ready": False, "started": False, "state": {"terminated": terminated}})
        return self._status(current, {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": statuses})


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
