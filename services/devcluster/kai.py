"""What stands in for KAI-Scheduler on the local control plane: its admission, its scheduler's GPU booking and its binder.

Read from KAI's source (third_party/kai-scheduler at d5bc503) and kept honest by a differential test against the
real admission (tests/kai): admission names the pod's shared-GPU ConfigMaps and points the fraction container's env
at them; the scheduler books GPU memory per device; the binder writes portion, devices and (hamicore) the limit into
the ConfigMap, then binds through the `binding` subresource. `KaiOptions` are the flags KAI's operator sets.
A DEV AND TEST FIXTURE: a real cluster runs KAI-Scheduler itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import hashlib
import logging
import math
import re
import secrets
import ssl
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kai_isolator.shared.contract import (
    GPU_GROUP_LABEL, KAI_CONFIGMAP_ANNOTATION, NUM_DEVICES_ANNOTATION, RESERVATION_NAMESPACE, RESERVED_GPU_ANNOTATION, gpu_groups,
)
from kai_isolator.shared.pki import CertificateAuthority

from .api import AsyncApi
from .plane import ApiCallError

log = logging.getLogger(__name__)

Obj = dict[str, Any]
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
HOSTNAME_LABEL = "kubernetes.io/hostname"
SIMULATED_LABEL = "devcluster.kai-isolator.io/simulated"
CONFIGMAP_ANNOTATION = KAI_CONFIGMAP_ANNOTATION
FRACTION_CONTAINER_ANNOTATION = "gpu-fraction-container-name"
RECEIVED_TYPE_ANNOTATION = "received-resource-type"
LIMIT_ENV = "CUDA_DEVICE_MEMORY_LIMIT"
DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
PORTION_ENV = "GPU_PORTION"
NUM_GPUS_ENV = "RUNAI_NUM_OF_GPUS"  # KAI's deprecated twin of GPU_PORTION, still written
GPU_RESOURCE = "nvidia.com/gpu"
CDI_PREFIX = "k8s.device-plugin.nvidia.com/gpu="
SCHEDULER_NAME = "kai-scheduler"
# KAI's operator's names: the configuration sorts after ours (kai-resource-isolator-mutating), so the API server calls
# ours first and, as KAI changes the pod, ours again (reinvocationPolicy IfNeeded).
ADMISSION_NAME = "mutating-kai-admission"
ADMISSION_WEBHOOK = "admission.kai-scheduler.svc"
KAI_NAMESPACE = "kai-scheduler"
DEFAULT_GPU_MEMORY_MIB = 100  # what KAI's scheduler assumes for a node without a readable memory label
_MIB_PER_TIB = 1024 * 1024
_RANDOM_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery utilrand.String's
GPU_SHARING_CONDITION = {
    "name": "gpu-sharing-pods",
    "expression": "has(object.metadata.annotations) && "
                  "('gpu-fraction' in object.metadata.annotations || 'gpu-memory' in object.metadata.annotations)",
}


class KaiRefused(ValueError):
    """KAI's admission rejects the pod (a bad GPU request, or no fraction container), with KAI's own message."""


class KaiCannotBind(RuntimeError):
    """KAI's binder fails the bind (after PR #2157: no limit can be computed); the pod stays Pending."""


@dataclass(frozen=True)
class KaiOptions:
    """The flags KAI's operator gives admission and binder, with the seed's install as the default
    (`global.gpuSharing=true`, `binder.plugins.hamicore.enabled=true`), and which upstream behaviour to follow."""

    scheduler_name: str = SCHEDULER_NAME
    gpu_sharing: bool = True  # admission --gpu-sharing-enabled
    hamicore: bool = True  # admission --hami-core-enabled and the binder's hamicore plugin
    runtime_class: str = "nvidia"  # admission --gpu-fraction-runtime-class-name (its default; "" sets none)
    cdi: bool = False  # the binder names devices in CDI form (the device plugin uses CDI)
    fail_bind_without_limit: bool = False  # PR #2157: the bind fails when no limit can be computed
    floor_gpu_memory: bool = True  # before PR #2041: the scheduler floors the node's GPU memory to 100 MiB
    # The simulation's own switch, not KAI's: False places every share on the node's first GPU(s) however full, for
    # tests that run dozens of pods on one simulated node and test something else than KAI's capacity.
    book_capacity: bool = True
    # What the reservation pods run. KAI's runs its resourcereservation program, which asks NVML for its GPU; the
    # simulation writes the GPU's UUID on the pod itself, so any program that stays up will do (KAI's --fake-gpu-nodes
    # mode runs `sleep infinity` likewise).
    reservation_image: str = "registry/local/kai-scheduler/resourcereservation:0.0.0"


SEED = KaiOptions()


# --- admission -----------------------------------------------------------------------------------


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


def _whole_gpu_limit(pod: Obj) -> bool:
    spec = pod.get("spec") or {}
    return any(GPU_RESOURCE in ((c.get("resources") or {}).get("limits") or {})
               for c in (spec.get("containers") or []) + (spec.get("initContainers") or []))


def _unsigned(text: str) -> int | None:
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


def kai_validate(pod: Obj, options: KaiOptions = SEED) -> None:
    """KAI's gpusharing Validate (gpu-request validator): its checks in its order, its messages."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    fraction, memory, count = annotations.get("gpu-fraction"), annotations.get("gpu-memory"), annotations.get(NUM_DEVICES_ANNOTATION)
    meta = pod.get("metadata") or {}
    if not options.gpu_sharing and is_gpu_sharing(pod):
        raise KaiRefused(f"attempting to create a pod {meta.get('namespace', '')}/{meta.get('name', '')} with gpu sharing request, "
                         "while GPU sharing is disabled")
    whole = _whole_gpu_limit(pod)
    if annotations.get("mps") == "true" and fraction is None and memory is None:
        raise KaiRefused("MPS is only supported with GPU fraction request")
    if fraction is not None and whole:
        raise KaiRefused("cannot have both GPU fraction request and whole GPU resource request/limit")
    if memory is not None and (fraction is not None or whole):
        raise KaiRefused("cannot request both GPU and GPU memory")
    if count is not None and fraction is None and memory is None:
        raise KaiRefused("cannot request multiple fractional devices without specifying fraction portion or gpu-memory")
    if memory is not None and not _unsigned(memory):
        raise KaiRefused("gpu-memory annotation value must be a positive integer greater than 0")
    if fraction is not None:
        try:
            value = float(fraction)
        except ValueError:
            value = math.nan
        if not 0 < value < 1:
            raise KaiRefused("gpu-fraction annotation value must be a positive number smaller than 1.0")
    if count is not None and not _unsigned(count):
        raise KaiRefused("fraction count annotation value must be a positive integer greater than 0")


def configmap_prefix(pod: Obj, index: str) -> str:
    """`<base>-<7 random>-shared-gpu`, the base the pod's (or its first owner's) name cut so that
    `<prefix>-<index>-evar` and `<prefix>-<index>-vol` stay within a 63-character volume name."""
    meta = pod.get("metadata") or {}
    owners = meta.get("ownerReferences") or []
    base = str(owners[0].get("name") or "") if owners else str(meta.get("name") or "")
    index_digits = len(index.lstrip("i"))  # KAI measures the number, not the `i`
    base = base[:63 - 13 - len("shared-gpu") - index_digits - 1 - 5].rstrip(".-")
    random = "".join(secrets.choice(_RANDOM_ALPHABET) for _ in range(7))
    return f"{base}-{random}-shared-gpu"


def _set_env(container: Obj, entry: Obj) -> None:
    """KAI's AddEnvVarToContainer: any entry of that name goes, the new one is appended."""
    container["env"] = [e for e in container.get("env") or [] if e.get("name") != entry["name"]] + [entry]


def _from_configmap(name: str, configmap: str, optional: bool | None = None) -> Obj:
    ref: Obj = {"name": configmap, "key": name}
    if optional is not None:
        ref["optional"] = optional
    return {"name": name, "valueFrom": {"configMapKeyRef": ref}}


def kai_admit(pod: Obj, options: KaiOptions = SEED) -> Obj:
    """The pod as KAI's mutating then validating admission leave it (plugins gpusharing, hamicore, runtimeenforcement),
    for a pod that names KAI's scheduler; any other pod is not KAI's and comes back as it was.

    Raises KaiRefused where KAI rejects the pod, with its message.
    """
    pod = copy.deepcopy(pod)
    if (pod.get("spec") or {}).get("schedulerName") != options.scheduler_name:
        return pod
    if is_gpu_sharing(pod) and (pod.get("spec") or {}).get("containers"):
        target = fraction_container(pod)
        if target is None:
            wanted = (pod["metadata"].get("annotations") or {}).get(FRACTION_CONTAINER_ANNOTATION)
            raise KaiRefused(f"failed to get fraction container ref: container with name {wanted} not found for fraction request")
        container, index = target
        annotations = pod["metadata"].setdefault("annotations", {})
        prefix = annotations.setdefault(CONFIGMAP_ANNOTATION, configmap_prefix(pod, index))
        capabilities = f"{prefix}-{index}"
        for name in (DEVICES_ENV, NUM_GPUS_ENV, PORTION_ENV):  # gpusharing: required, the container waits for them
            _set_env(container, _from_configmap(name, capabilities))
        volume = re.sub(r"[^a-z0-9-]+", "-", f"{capabilities}-vol".lower()).strip("-")
        pod["spec"]["volumes"] = [v for v in pod["spec"].get("volumes") or [] if v.get("name") != volume] + [
            {"name": volume, "configMap": {"name": capabilities}}]
        evar = f"{capabilities}-evar"
        if not any((s.get("configMapRef") or {}).get("name") == evar for s in container.get("envFrom") or []):
            container["envFrom"] = (container.get("envFrom") or []) + [{"configMapRef": {"name": evar, "optional": False}}]
        if options.hamicore:  # hamicore: the limit its binder plugin writes, optional (no limit: the container still starts)
            _set_env(container, _from_configmap(LIMIT_ENV, capabilities, optional=True))
        if options.runtime_class and not pod["spec"].get("runtimeClassName"):
            pod["spec"]["runtimeClassName"] = options.runtime_class
    kai_validate(pod, options)
    return pod


def _json_patch(before: Obj, after: Obj) -> list[Obj]:
    """The patch from a pod to its KAI-admitted self: every field KAI's admission may set, set whole."""
    ops: list[Obj] = []
    if before["metadata"].get("annotations") != after["metadata"].get("annotations"):
        ops.append({"op": "add", "path": "/metadata/annotations", "value": after["metadata"].get("annotations") or {}})
    for field in ("volumes", "runtimeClassName"):
        if before["spec"].get(field) != after["spec"].get(field):
            ops.append({"op": "add", "path": f"/spec/{field}", "value": after["spec"][field]})
    for key in ("initContainers", "containers"):
        for index, (old, new) in enumerate(zip(before["spec"].get(key) or [], after["spec"].get(key) or [])):
            for field in ("env", "envFrom"):
                if old.get(field) != new.get(field):
                    ops.append({"op": "add", "path": f"/spec/{key}/{index}/{field}", "value": new[field]})
    return ops


# --- the scheduler's arithmetic -------------------------------------------------------------------


def node_gpu_memory_mib(label: str | None, options: KaiOptions = SEED) -> int:
    """The per-GPU memory KAI's scheduler plans with: the label (bytes when it is ≥ 1 TiB in MiB), floored to a
    multiple of 100 before PR #2041; 100 MiB when the label is missing or unreadable."""
    try:
        mib = int(label or "")
    except ValueError:
        return DEFAULT_GPU_MEMORY_MIB
    if mib >= _MIB_PER_TIB:
        mib //= _MIB_PER_TIB
    return mib - mib % 100 if options.floor_gpu_memory else mib


def booked_mib(annotations: dict[str, str], node_mib: int) -> int:
    """The memory one device books for the pod: gpu-memory as asked, a fraction of the planned card."""
    if "gpu-memory" in annotations:
        return int(annotations["gpu-memory"])
    return int(float(annotations["gpu-fraction"]) * node_mib)


def gpu_portion(annotations: dict[str, str], node_mib: int) -> str:
    """The BindRequest's per-device portion: gpu-memory over the planned card, rounded up to 0.01, or the fraction."""
    if "gpu-memory" in annotations:
        return f"{math.ceil(int(annotations['gpu-memory']) / node_mib * 100) / 100:.2f}"
    return f"{float(annotations['gpu-fraction']):.2f}"


def num_devices(annotations: dict[str, str]) -> int:
    return int(annotations.get(NUM_DEVICES_ANNOTATION) or 1)


def scheduler_portion(annotations: dict[str, str], label_mib: int, options: KaiOptions = SEED) -> str | None:
    """The BindRequest portion for a node labelled `label_mib`, or None where KAI would not place the pod."""
    try:
        return gpu_portion(annotations, node_gpu_memory_mib(str(label_mib), options))
    except (KeyError, ValueError, ZeroDivisionError):
        return None


def hamicore_limit(label: str | None, portion: str) -> str | None:
    """`CUDA_DEVICE_MEMORY_LIMIT` as the binder's hamicore plugin computes it: int(raw label × portion) MiB, e.g. `4147m`;
    None where it cannot (no or bad label, a zero result)."""
    try:
        label_mib = int(label or "")
    except ValueError:
        return None
    mib = int(float(label_mib) * float(portion))
    return f"{mib}m" if label_mib > 0 and mib > 0 else None


def kai_memory_limit(annotations: dict[str, str], label_mib: int, options: KaiOptions = SEED) -> str | None:
    portion = scheduler_portion(annotations, label_mib, options)
    return None if portion is None else hamicore_limit(str(label_mib), portion)


def fake_gpu_uuid(index: int) -> str:
    """The UUID hami-core's fake NVML reports for device `index`: what KAI's reservation pod would learn."""
    return f"GPU-{index:02d}00fa4e-1111-2222-3333-{index:012d}"


def gpu_group(node: str, index: int) -> str:
    """The name of GPU `index` of `node` as a GPU group (KAI's scheduler makes up a UUID per shared GPU)."""
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{index}.{node}.gpu.devcluster.kai-isolator.io"))


# --- the binder ------------------------------------------------------------------------------------


def gpu_group_labels(node: str, gpus: list[int]) -> dict[str, str]:
    """The GPU-group labels KAI's binder puts on a sharing pod: one label, or one per device for several."""
    if len(gpus) == 1:
        return {GPU_GROUP_LABEL: gpu_group(node, gpus[0])}
    return {f"{GPU_GROUP_LABEL}/{gpu_group(node, i)}": gpu_group(node, i) for i in gpus}


def reservation_pod(node: str, gpu: int, options: KaiOptions = SEED) -> Obj:
    """KAI's reservation pod for GPU `gpu` of `node`, as it is once its program has written the GPU's UUID on it. It asks
    for no `nvidia.com/gpu`, unlike KAI's: on a real node the simulated reservation would take the device plugin's GPU
    from the tests' whole-GPU pods. Named by a hash of node and group, as KAI names its own."""
    group = gpu_group(node, gpu)
    name = "gpu-reservation-" + hashlib.sha256(f"{node}/{group}".encode()).hexdigest()[:16]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": RESERVATION_NAMESPACE,
                         "labels": {"app": RESERVATION_NAMESPACE, GPU_GROUP_LABEL: group},
                         "annotations": {RESERVED_GPU_ANNOTATION: fake_gpu_uuid(gpu)}},
            "spec": {"nodeName": node, "containers": [{"name": "resource-reservation", "image": options.reservation_image}]}}


def binder_configmaps(pod: Obj, node_labels: dict[str, str], portion: str, devices: list[str],
                      options: KaiOptions = SEED) -> list[Obj]:
    """The ConfigMaps KAI's binder leaves at PreBind: `<prefix>-<index>` with devices and portion (and, hamicore, the
    limit), and `<prefix>-<index>-evar`, empty. Raises KaiCannotBind where KAI (after PR #2157) fails the bind."""
    annotations = pod["metadata"].get("annotations") or {}
    target = fraction_container(pod)
    if target is None or CONFIGMAP_ANNOTATION not in annotations:
        raise KaiCannotBind("no desired configmap name found in pod annotations")
    container, index = target
    capabilities = f"{annotations[CONFIGMAP_ANNOTATION]}-{index}"
    listed = ",".join(f"{CDI_PREFIX}{d}" if options.cdi else d for d in devices)
    data = {NUM_GPUS_ENV: portion, PORTION_ENV: portion}
    evar_data: dict[str, str] = {}
    # The devices go where the container reads them: its env entry when KAI's admission set one, else its envFrom.
    reads_devices = any(e.get("name") == DEVICES_ENV and (e.get("valueFrom") or {}).get("configMapKeyRef") for e in container.get("env") or [])
    (data if reads_devices else evar_data)[DEVICES_ENV] = listed
    if options.hamicore:
        limit = hamicore_limit(node_labels.get(GPU_MEMORY_LABEL), portion)
        if limit is not None:
            data[LIMIT_ENV] = limit
        elif options.fail_bind_without_limit:
            raise KaiCannotBind(f"cannot compute {LIMIT_ENV}: node label {GPU_MEMORY_LABEL}={node_labels.get(GPU_MEMORY_LABEL)!r}")
    owner = [{"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]

    def configmap(name: str, values: dict[str, str]) -> Obj:
        body: Obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "ownerReferences": owner}}
        if values:
            body["data"] = values
        return body
    return [configmap(capabilities, data), configmap(f"{capabilities}-evar", evar_data)]


def limit_configmap(pod: Obj, gpu_memory_mib: int, options: KaiOptions = SEED) -> Obj | None:
    """The capabilities ConfigMap KAI's binder writes for a GPU-sharing pod on GPU 0 of a node labelled
    `gpu_memory_mib`, or None for any other pod."""
    annotations = pod["metadata"].get("annotations") or {}
    if not is_gpu_sharing(pod) or fraction_container(pod) is None or CONFIGMAP_ANNOTATION not in annotations:
        return None
    portion = scheduler_portion(annotations, gpu_memory_mib, options) or "0.00"
    devices = [fake_gpu_uuid(i) for i in range(num_devices(annotations))]
    return binder_configmaps(pod, {GPU_MEMORY_LABEL: str(gpu_memory_mib)}, portion, devices, options)[0]


async def _upsert(api: AsyncApi, namespace: str, body: Obj) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    with contextlib.suppress(ApiCallError):
        await api.request("DELETE", f"{path}/{body['metadata']['name']}")
    await api.request("POST", path, body)


# What KAI's chart makes for its reservation pods, before any: their namespace and ServiceAccount (the pods name the
# namespace's `default` one here, which no controller-manager makes on the local control plane).
RESERVATION_SETUP = (("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": RESERVATION_NAMESPACE}}),
                     (f"/api/v1/namespaces/{RESERVATION_NAMESPACE}/serviceaccounts",
                      {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}))


async def reserve(api: AsyncApi, pod: Obj) -> None:
    """The GPU group's reservation pod, made once (in a namespace made once), kept while the simulation runs."""
    for path, body in RESERVATION_SETUP:
        with contextlib.suppress(ApiCallError):  # 409: made before
            await api.request("POST", path, body)
    try:
        await api.request("POST", f"/api/v1/namespaces/{RESERVATION_NAMESPACE}/pods", pod)
    except ApiCallError as error:
        if error.code != 409:
            raise


async def kai_bind(api: AsyncApi, pod: Obj, node: str, gpu_memory_mib: int | None = None, *, node_labels: dict[str, str] | None = None,
                   gpus: list[int] | None = None, options: KaiOptions = SEED) -> None:
    """KAI's binder: GPU-group labels and the received type on the pod, PreBind's ConfigMaps, then the binding.
    Raises KaiCannotBind (nothing written) where KAI fails the bind."""
    meta = pod["metadata"]
    labels = dict(node_labels) if node_labels is not None else {GPU_MEMORY_LABEL: str(gpu_memory_mib)}
    if is_gpu_sharing(pod):
        annotations = meta.get("annotations") or {}
        portion = gpu_portion(annotations, node_gpu_memory_mib(labels.get(GPU_MEMORY_LABEL), options))
        chosen = gpus if gpus is not None else list(range(num_devices(annotations)))
        configmaps = binder_configmaps(pod, labels, portion, [fake_gpu_uuid(i) for i in chosen], options)
        for gpu in chosen:
            await reserve(api, reservation_pod(node, gpu, options))
        groups = gpu_group_labels(node, chosen)
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        await api.request("PATCH", path, {"metadata": {"labels": groups, "annotations": {RECEIVED_TYPE_ANNOTATION: "Fraction"}}},
                          content_type="application/merge-patch+json")
        for configmap in configmaps:
            await _upsert(api, meta["namespace"], configmap)
    await bind_pod(api, pod, node)


async def bind_pod(api: AsyncApi, pod: Obj, node: str) -> None:
    """The `binding` subresource, as any scheduler binds."""
    meta = pod["metadata"]
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
               "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    await api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", binding)


# --- served on the local control plane ------------------------------------------------------------------


class KaiAdmission:
    """KAI's pod-mutating webhook, served over TLS on loopback and registered in the API server as KAI's operator does."""

    def __init__(self, workdir: Path, options: KaiOptions = SEED) -> None:
        self.workdir = workdir
        self.options = options
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._ca = CertificateAuthority("kai-isolator local KAI admission")

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cert, key = self._ca.issue_server(["127.0.0.1"]).write(self.workdir / "kai-admission.crt", self.workdir / "kai-admission.key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
        app = web.Application()
        app.router.add_post("/mutate--v1-pod", self._mutate)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        self.url = f"https://127.0.0.1:{self._runner.addresses[0][1]}/mutate--v1-pod"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def configuration(self) -> Obj:
        """KAI's operator's MutatingWebhookConfiguration (pkg/operator/operands/admission), pointed at this server.
        KAI's validating webhook is folded into this one: a pod it would reject is rejected here, at the same step
        of its creation for the pod's author (UPDATEs, which KAI also validates, are not)."""
        hook = {
            "name": ADMISSION_WEBHOOK, "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "clientConfig": {"url": self.url, "caBundle": base64.b64encode(self._ca.cert_pem).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced"}],
            "failurePolicy": "Fail", "reinvocationPolicy": "IfNeeded",
            "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                                        "values": ["kube-system", KAI_NAMESPACE]}]},
            "matchConditions": [{"name": "scheduler-name-match", "expression": f"object.spec.schedulerName == '{self.options.scheduler_name}'"}],
        }
        return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": ADMISSION_NAME, "labels": {"app": "admission"}}, "webhooks": [hook]}

    async def _mutate(self, request: web.Request) -> web.Response:
        review = orjson.loads(await request.read())
        pod = review["request"]["object"]
        pod.setdefault("metadata", {}).setdefault("namespace", review["request"].get("namespace", ""))
        response: Obj = {"uid": review["request"]["uid"], "allowed": True}
        try:
            admitted = kai_admit(pod, self.options)
        except KaiRefused as error:  # controller-runtime's Denied: 403, the plugin's message
            response = {**response, "allowed": False, "status": {"code": 403, "reason": "Forbidden", "message": str(error)}}
        else:
            patch = _json_patch(pod, admitted)
            if patch:
                response |= {"patchType": "JSONPatch", "patch": base64.b64encode(orjson.dumps(patch)).decode()}
        return web.Response(body=orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}),
                            content_type="application/json")


def _node_gpus(labels: dict[str, str]) -> int:
    try:
        return max(1, int(labels.get(GPU_COUNT_LABEL) or 1))
    except ValueError:
        return 1


class KaiScheduler:
    """Binds pending `kai-scheduler` pods to the simulated GPU node they name (nodeSelector), or to the first node with
    room, booking GPU memory per device as KAI does; a pod that fits nowhere stays Pending and is tried again."""

    def __init__(self, api: AsyncApi, nodes: dict[str, int], step_s: float = 0.2, options: KaiOptions = SEED,
                 retry_s: float = 0.5) -> None:
        self.api = api
        # Next to a real kube-scheduler, only pods that name KAI's scheduler are KAI's to bind.
        self.only_kai_pods = False
        self.nodes = nodes  # name -> GPU memory label, MiB (the node objects' labels are what counts)
        self.step_s = step_s
        self.options = options
        self.retry_s = retry_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: set[str] = set()  # uids with a bind attempt on its way
        self._lock = asyncio.Lock()  # one booking at a time, as KAI's one scheduling cycle
        self._informer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._informer = asyncio.create_task(self.api.informer("/api/v1/pods?fieldSelector=spec.nodeName%3D", self._on_pod),
                                             name="devcluster-kai-scheduler")

    async def stop(self) -> None:
        for task in [self._informer, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._informer, *self._tasks] if t is not None), return_exceptions=True)

    def candidates(self, pod: Obj) -> list[str]:
        spec = pod.get("spec") or {}
        if spec.get("schedulerName") != self.options.scheduler_name:
            if self.only_kai_pods:
                return []
            wanted = (spec.get("nodeSelector") or {}).get(HOSTNAME_LABEL)
            return [wanted] if wanted in self.nodes else []
        wanted = (spec.get("nodeSelector") or {}).get(HOSTNAME_LABEL)
        if wanted:
            return [wanted] if wanted in self.nodes else []
        return list(self.nodes)

    def node_for(self, pod: Obj) -> str | None:
        found = self.candidates(pod)
        return found[0] if found else None

    async def _on_pod(self, kind: str, pod: Obj) -> None:
        meta = pod["metadata"]
        if kind == "DELETED" or pod["spec"].get("nodeName") or meta.get("deletionTimestamp") or meta["uid"] in self._waiting:
            return
        if self.candidates(pod):
            self._waiting.add(meta["uid"])
            task = asyncio.create_task(self._bind_later(pod))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _bind_later(self, pod: Obj) -> None:
        meta = pod["metadata"]
        try:
            await asyncio.sleep(self.step_s)
            while True:
                try:
                    current = await self.api.request("GET", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")
                    if current["metadata"]["uid"] != meta["uid"] or current["spec"].get("nodeName") or current["metadata"].get("deletionTimestamp"):
                        return
                    async with self._lock:
                        if await self._try_bind(current):
                            return
                except ApiCallError as error:
                    # Another event's timer bound it first (409), or the pod is gone (404): nothing is lost.
                    log.debug("bind of %s/%s skipped: %s", meta["namespace"], meta["name"], error)
                    return
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                    log.debug("bind of %s/%s waits for the API server: %r", meta["namespace"], meta["name"], error)  # restarted
                await asyncio.sleep(self.retry_s)  # no room (or KAI could not bind): Pending, as with KAI, until there is
        finally:
            self._waiting.discard(meta["uid"])

    async def _try_bind(self, pod: Obj) -> bool:
        annotations = pod["metadata"].get("annotations") or {}
        kais = pod["spec"].get("schedulerName") == self.options.scheduler_name
        for node in self.candidates(pod):
            if not (kais and is_gpu_sharing(pod)):  # the default scheduler's stand-in books no GPU and writes no ConfigMap
                await bind_pod(self.api, pod, node)
                return True
            labels = (await self.api.request("GET", f"/api/v1/nodes/{node}"))["metadata"].get("labels") or {}
            chosen = await self._fitting_gpus(node, labels, annotations)
            if chosen is None:
                continue
            try:
                await kai_bind(self.api, pod, node, node_labels=labels, gpus=chosen, options=self.options)
            except KaiCannotBind as error:
                log.info("KAI cannot bind %s/%s to %s: %s", pod["metadata"]["namespace"], pod["metadata"]["name"], node, error)
                return False
            return True
        return False

    async def _fitting_gpus(self, node: str, labels: dict[str, str], annotations: dict[str, str]) -> list[int] | None:
        """The GPUs of `node` the pod fits on, one per device it asks for (the fullest first, as KAI packs), or None."""
        count = num_devices(annotations)
        if not self.options.book_capacity:
            return list(range(count))
        planned = node_gpu_memory_mib(labels.get(GPU_MEMORY_LABEL), self.options)
        wanted = booked_mib(annotations, planned)
        used = await self._booked(node, planned)
        room = sorted((i for i in range(_node_gpus(labels)) if planned - used.get(gpu_group(node, i), 0) - wanted >= 0),
                      key=lambda i: -used.get(gpu_group(node, i), 0))
        return sorted(room[:count]) if len(room) >= count else None

    async def _booked(self, node: str, planned: int) -> dict[str, int]:
        """Memory booked per GPU group on `node` by the pods bound there that have not ended."""
        pods = (await self.api.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}"))["items"]
        used: dict[str, int] = {}
        for pod in pods:
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") or not is_gpu_sharing(pod):
                continue
            annotations = pod["metadata"].get("annotations") or {}
            for group in gpu_groups(pod["metadata"].get("labels") or {}):
                used[group] = used.get(group, 0) + booked_mib(annotations, planned)
        return used
