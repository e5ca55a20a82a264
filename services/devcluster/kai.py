"""What stands in for KAI-Scheduler on the local control plane: its admission (the limit env), its scheduler and binder.

KAI's arithmetic is spelled here once (kai-resource-isolator.md §6): the binder writes `CUDA_DEVICE_MEMORY_LIMIT`
into a per-pod ConfigMap that the env KAI's admission added reads, then binds through the `binding` subresource.
A DEV AND TEST FIXTURE: a real cluster runs KAI-Scheduler itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import logging
import math
import secrets
import ssl
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from kai_isolator.shared.pki import CertificateAuthority

from .api import AsyncApi
from .plane import ApiCallError

log = logging.getLogger(__name__)

Obj = dict[str, Any]
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
HOSTNAME_LABEL = "kubernetes.io/hostname"
SIMULATED_LABEL = "devcluster.kai-isolator.io/simulated"
CONFIGMAP_ANNOTATION = "runai/shared-gpu-configmap"
FRACTION_CONTAINER_ANNOTATION = "gpu-fraction-container-name"
LIMIT_ENV = "CUDA_DEVICE_MEMORY_LIMIT"
DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
SCHEDULER_NAME = "kai-scheduler"
ADMISSION_NAME = "kai-admission"  # sorts before ours, as KAI's own webhook runs first on a real cluster
_MIB_PER_TIB = 1024 * 1024
GPU_SHARING_CONDITION = {
    "name": "gpu-sharing-pods",
    "expression": "has(object.metadata.annotations) && "
                  "('gpu-fraction' in object.metadata.annotations || 'gpu-memory' in object.metadata.annotations)",
}


def is_gpu_sharing(pod: Obj) -> bool:
    annotations = pod.get("metadata", {}).get("annotations") or {}
    return "gpu-fraction" in annotations or "gpu-memory" in annotations


def fraction_container(pod: Obj) -> tuple[Obj, str] | None:
    """The container KAI targets and its ConfigMap index suffix (`0`, or `i0` for init containers)."""
    spec = pod.get("spec") or {}
    wanted = (pod.get("metadata", {}).get("annotations") or {}).get(FRACTION_CONTAINER_ANNOTATION)
    if wanted:
        for prefix, key in (("i", "initContainers"), ("", "containers")):
            for index, container in enumerate(spec.get(key) or []):
                if container.get("name") == wanted:
                    return container, f"{prefix}{index}"
        return None
    containers = spec.get("containers") or []
    return (containers[0], "0") if containers else None


def scheduler_portion(annotations: dict[str, str], label_mib: int) -> str | None:
    """The BindRequest portion string KAI's scheduler computes, or None where KAI would fail."""
    node_mib = label_mib // _MIB_PER_TIB if label_mib >= _MIB_PER_TIB else label_mib
    node_mib -= node_mib % 100
    try:
        if "gpu-memory" in annotations:
            requested = int(annotations["gpu-memory"])
            if requested <= 0 or node_mib <= 0:
                return None
            portion = math.ceil(requested / node_mib * 100) / 100
        else:
            portion = float(annotations["gpu-fraction"])
            if not 0 < portion < 1:
                return None
    except (KeyError, ValueError):
        return None
    return f"{portion:.2f}"


def kai_memory_limit(annotations: dict[str, str], label_mib: int) -> str | None:
    """`CUDA_DEVICE_MEMORY_LIMIT` as KAI's binder writes it: int(raw label x portion) MiB, e.g. `4147m`.

    None where KAI-Scheduler writes no value (bad label, portion 0): the pod then runs uncapped.
    """
    portion = scheduler_portion(annotations, label_mib)
    if portion is None or label_mib <= 0:
        return None
    mib = int(float(label_mib) * float(portion))
    return f"{mib}m" if mib > 0 else None


def fake_gpu_uuid(index: int) -> str:
    """The UUID hami-core's fake NVML reports for device `index`: what KAI's reservation pod would learn."""
    return f"GPU-{index:02d}00fa4e-1111-2222-3333-{index:012d}"


def kai_admit(pod: Obj) -> Obj:
    """The pod as KAI's gpusharing admission leaves it: the shared-GPU ConfigMap's name, and env read from it.

    Raises ValueError where KAI refuses the pod (the container it should target is missing).
    """
    pod = copy.deepcopy(pod)
    if not is_gpu_sharing(pod):
        return pod
    target = fraction_container(pod)
    if target is None:
        wanted = (pod["metadata"].get("annotations") or {}).get(FRACTION_CONTAINER_ANNOTATION)
        raise ValueError(f"container with name {wanted} not found for fraction request")
    container, index = target
    annotations = pod["metadata"].setdefault("annotations", {})
    base = (pod["metadata"].get("name") or pod["metadata"].get("generateName") or "pod").rstrip("-")[:40]
    prefix = annotations.setdefault(CONFIGMAP_ANNOTATION, f"{base}-{secrets.token_hex(3)}-shared-gpu")
    env = [e for e in container.get("env") or [] if e.get("name") not in (LIMIT_ENV, DEVICES_ENV)]
    env.append({"name": LIMIT_ENV, "valueFrom": {"configMapKeyRef": {"name": f"{prefix}-{index}", "key": LIMIT_ENV, "optional": True}}})
    # gpusharing's: the GPU the reservation pod holds, not optional (the container waits for it).
    env.append({"name": DEVICES_ENV, "valueFrom": {"configMapKeyRef": {"name": f"{prefix}-{index}", "key": DEVICES_ENV}}})
    container["env"] = env
    return pod


def limit_configmap(pod: Obj, gpu_memory_mib: int) -> Obj | None:
    """The ConfigMap KAI's binder writes at PreBind for a GPU-sharing pod, or None for any other pod."""
    annotations = pod["metadata"].get("annotations") or {}
    target = fraction_container(pod)
    if not is_gpu_sharing(pod) or target is None or CONFIGMAP_ANNOTATION not in annotations:
        return None
    data = {"GPU_PORTION": scheduler_portion(annotations, gpu_memory_mib) or "0.00", DEVICES_ENV: fake_gpu_uuid(0)}
    limit = kai_memory_limit(annotations, gpu_memory_mib)
    if limit is not None:
        data[LIMIT_ENV] = limit
    owner = [{"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
            "metadata": {"name": f"{annotations[CONFIGMAP_ANNOTATION]}-{target[1]}", "ownerReferences": owner}}


async def kai_bind(api: AsyncApi, pod: Obj, node: str, gpu_memory_mib: int) -> None:
    """KAI's binder: PreBind writes the limit into the pod's ConfigMap, then the pod is bound to `node`."""
    meta = pod["metadata"]
    configmap = limit_configmap(pod, gpu_memory_mib)
    if configmap is not None:
        path = f"/api/v1/namespaces/{meta['namespace']}/configmaps"
        with contextlib.suppress(ApiCallError):
            await api.request("DELETE", f"{path}/{configmap['metadata']['name']}")
        await api.request("POST", path, configmap)
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
               "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    await api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", binding)


def _json_patch(before: Obj, after: Obj) -> list[Obj]:
    """The patch from a pod to its KAI-admitted self: annotations and the targeted container's env."""
    ops: list[Obj] = [{"op": "add", "path": "/metadata/annotations", "value": after["metadata"].get("annotations") or {}}]
    for key in ("initContainers", "containers"):
        for index, (old, new) in enumerate(zip(before["spec"].get(key) or [], after["spec"].get(key) or [])):
            if old.get("env") != new.get("env"):
                ops.append({"op": "add", "path": f"/spec/{key}/{index}/env", "value": new["env"]})
    return ops


class KaiAdmission:
    """KAI's pod-mutating webhook, served over TLS on loopback and registered in the API server."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._ca = CertificateAuthority("kai-isolator local KAI admission")

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cert, key = self._ca.issue_server(["127.0.0.1"]).write(self.workdir / "kai-admission.crt", self.workdir / "kai-admission.key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
        app = web.Application()
        app.router.add_post("/mutate", self._mutate)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        self.url = f"https://127.0.0.1:{self._runner.addresses[0][1]}/mutate"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def configuration(self) -> Obj:
        hook = {
            "name": "gpusharing.kai.scheduler", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "clientConfig": {"url": self.url, "caBundle": base64.b64encode(self._ca.cert_pem).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced"}],
            "failurePolicy": "Fail", "timeoutSeconds": 5, "matchConditions": [GPU_SHARING_CONDITION],
        }
        return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": ADMISSION_NAME}, "webhooks": [hook]}

    async def _mutate(self, request: web.Request) -> web.Response:
        review = orjson.loads(await request.read())
        pod = review["request"]["object"]
        response: Obj = {"uid": review["request"]["uid"], "allowed": True}
        try:
            admitted = kai_admit(pod)
        except ValueError as error:
            response = {**response, "allowed": False, "status": {"code": 400, "message": str(error)}}
        else:
            patch = _json_patch(pod, admitted)
            response |= {"patchType": "JSONPatch", "patch": base64.b64encode(orjson.dumps(patch)).decode()}
        return web.Response(body=orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}),
                            content_type="application/json")


class KaiScheduler:
    """Binds pending pods to the simulated GPU node they name (nodeSelector), or any `kai-scheduler` pod to the first node."""

    def __init__(self, api: AsyncApi, nodes: dict[str, int], step_s: float = 0.2) -> None:
        self.api = api
        # Next to a real kube-scheduler, only pods that name KAI's scheduler are KAI's to bind.
        self.only_kai_pods = False
        self.nodes = nodes  # name -> GPU memory label, MiB
        self.step_s = step_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._informer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._informer = asyncio.create_task(self.api.informer("/api/v1/pods?fieldSelector=spec.nodeName%3D", self._on_pod),
                                             name="devcluster-kai-scheduler")

    async def stop(self) -> None:
        for task in [self._informer, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._informer, *self._tasks] if t is not None), return_exceptions=True)

    def node_for(self, pod: Obj) -> str | None:
        spec = pod.get("spec") or {}
        if self.only_kai_pods and spec.get("schedulerName") != SCHEDULER_NAME:
            return None
        wanted = (spec.get("nodeSelector") or {}).get(HOSTNAME_LABEL)
        if wanted:
            return wanted if wanted in self.nodes else None
        if spec.get("schedulerName") == SCHEDULER_NAME and self.nodes:
            return next(iter(self.nodes))
        return None

    async def _on_pod(self, kind: str, pod: Obj) -> None:
        if kind == "DELETED" or pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
            return
        node = self.node_for(pod)
        if node is not None:
            task = asyncio.create_task(self._bind_later(pod, node))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _bind_later(self, pod: Obj, node: str) -> None:
        await asyncio.sleep(self.step_s)
        meta = pod["metadata"]
        try:
            current = await self.api.request("GET", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")
            if current["metadata"]["uid"] != meta["uid"] or current["spec"].get("nodeName"):
                return
            await kai_bind(self.api, current, node, self.nodes[node])
        except ApiCallError as error:
            # Another event's timer bound it first (409), or the pod is gone (404): nothing is lost.
            log.debug("bind of %s/%s skipped: %s", meta["namespace"], meta["name"], error)
