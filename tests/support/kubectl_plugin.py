"""For `kubectl isolator` tests: a Kubernetes API reached only through a kubeconfig, objects written the
way our services write them (the verifier's own condition and node-view writers), and the plugin run as
the installed console script. The API is the real kube-apiserver (`dev_cluster`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from kai_isolator.services.verifier.kube import PodNotifier

BIN = Path(sys.executable).parent
Obj = dict[str, Any]


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


class Cluster:
    """A kubeconfig plus helpers that write through the API, as users and our services do."""

    def __init__(self, kubeconfig: Path, api: client.ApiClient) -> None:
        self.kubeconfig = kubeconfig
        self.api = api
        self.core = client.CoreV1Api(api)
        self.notifier = PodNotifier(api)

    async def pod(self, name: str, *, namespace: str = "default", annotations: dict[str, str] | None = None, node: str | None = "gpu-1",
                  limit: str | None = "4147m", running: bool = True, injected: bool = True) -> Obj:
        env = [{"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": limit}] if limit else []
        spec: Obj = {"containers": [{"name": "main", "image": "busybox", "env": env}]}
        if injected:
            spec["volumes"] = [{"name": "kai-resource-isolator-vgpu", "hostPath": {"path": "/usr/local/vgpu", "type": "Directory"}}]
        if node:
            spec["nodeName"] = node
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations if annotations is not None else {"gpu-memory": "4096"}},
                "spec": spec}
        created = await self.core.create_namespaced_pod(namespace, body, _preload_content=False)
        pod: Obj = await created.json()
        if created.status != 201:
            raise AssertionError(f"creating pod {namespace}/{name}: HTTP {created.status}: {pod.get('message')}")
        if node and limit:
            await self._binder_configmap(pod, limit)
        if running:
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            status = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                                                                     {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}],
                                 "containerStatuses": [{"name": "main", "ready": True, "restartCount": 0, "image": "busybox", "imageID": "",
                                                        "state": {"running": {"startedAt": now}}}]}}
            patched = await self.core.patch_namespaced_pod_status(name, namespace, status, _preload_content=False)
            pod = await patched.json()
        return pod

    async def _binder_configmap(self, pod: Obj, limit: str) -> None:
        """KAI's binder writes the limit into the ConfigMap the pod's env refers to (where the env has such a reference)."""
        for env in pod["spec"]["containers"][0].get("env") or []:
            ref = (env.get("valueFrom") or {}).get("configMapKeyRef")
            if env["name"] == "CUDA_DEVICE_MEMORY_LIMIT" and ref:
                body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": ref["name"]},
                        "data": {"CUDA_DEVICE_MEMORY_LIMIT": limit, "NVIDIA_VISIBLE_DEVICES": "GPU-1"}}
                await self.core.create_namespaced_config_map(pod["metadata"]["namespace"], body, _preload_content=False)

    async def read_pod(self, name: str, namespace: str = "default") -> Obj:
        response = await self.core.read_namespaced_pod(name, namespace, _preload_content=False)
        return await response.json()  # type: ignore[no-any-return]

    async def node(self, name: str, *, memory_mib: int = 15360, gpus: int = 1) -> None:
        labels = {"nvidia.com/gpu.memory": str(memory_mib), "nvidia.com/gpu.count": str(gpus)}
        await self.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}, _preload_content=False)
        capacity = {"nvidia.com/gpu": str(gpus), "cpu": "8", "memory": "64Gi", "pods": "110"}
        await self.core.patch_node_status(name, {"status": {"capacity": capacity, "allocatable": capacity}}, _preload_content=False)

    async def namespace(self, name: str) -> None:
        """A namespace and its `default` ServiceAccount (no controller-manager creates it); kept from an earlier test is fine."""
        for create, body in ((lambda b: self.core.create_namespace(b, _preload_content=False), {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
                             (lambda b: self.core.create_namespaced_service_account(name, b, _preload_content=False),
                              {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})):
            response = await create(body)
            if response.status not in (201, 409):
                raise AssertionError(f"creating {body['kind']} {name}: HTTP {response.status}: {await response.text()}")

    async def plugin(self, *args: str, kubeconfig: Path | None = None, env: dict[str, str] | None = None) -> Result:
        """The installed console script, as `kubectl isolator` runs it."""
        return await run([str(BIN / "kubectl-isolator"), *args, "--kubeconfig", str(kubeconfig or self.kubeconfig)], env=env)


async def run(argv: list[str], env: dict[str, str] | None = None) -> Result:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                   env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return Result(process.returncode or 0, out.decode(), err.decode())


