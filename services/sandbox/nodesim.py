"""Node simulator for the sandbox API: fake GPU nodes that bind and "run" pods. A TEST AND DEMO FIXTURE.

It stands in for KAI-Scheduler and the kubelet: for GPU-sharing pods it writes
`CUDA_DEVICE_MEMORY_LIMIT` the way KAI does (an env var referencing a per-pod ConfigMap
the binder fills at bind time; kai-resource-isolator.md §6), binds pods that name one of
its nodes, and moves them Pending -> Running -> Succeeded/Failed with container statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import string
from collections.abc import Callable
from typing import Any

from .status import ApiError
from .store import Obj, Store, now_iso

log = logging.getLogger(__name__)

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
HOSTNAME_LABEL = "kubernetes.io/hostname"
CONFIGMAP_ANNOTATION = "runai/shared-gpu-configmap"
FRACTION_CONTAINER_ANNOTATION = "gpu-fraction-container-name"
LIMIT_ENV = "CUDA_DEVICE_MEMORY_LIMIT"
DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
# How long a simulated container runs and how it ends; absent = runs until deleted.
RUN_SECONDS_ANNOTATION = "sandbox.kai-isolator.io/run-seconds"
EXIT_CODE_ANNOTATION = "sandbox.kai-isolator.io/exit-code"
_MIB_PER_TIB = 1024 * 1024


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


def _random_suffix(length: int = 7) -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(length))


class NodeSimulator:
    """Simulated GPU nodes in one sandbox store; call `start()` to let it move pods along."""

    def __init__(self, store: Store, step_s: float = 0.2) -> None:
        self.store = store
        self.step_s = step_s
        self._task: asyncio.Task[None] | None = None
        self._timers: set[asyncio.Task[None]] = set()
        self._stream = None

    # --- nodes --------------------------------------------------------------------------

    def add_node(self, name: str, gpu_memory_mib: int = 15360, gpu_count: int = 1) -> Obj:
        labels = {HOSTNAME_LABEL: name, GPU_MEMORY_LABEL: str(gpu_memory_mib), "nvidia.com/gpu.count": str(gpu_count), "sandbox.kai-isolator.io/simulated": "true"}
        capacity = {"cpu": "16", "memory": "128Gi", "pods": "110", "nvidia.com/gpu": str(gpu_count)}
        node = {
            "metadata": {"name": name, "labels": labels},
            "spec": {},
            "status": {
                "capacity": capacity, "allocatable": capacity,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated node", "lastHeartbeatTime": now_iso(), "lastTransitionTime": now_iso()}],
                "nodeInfo": {"kubeletVersion": "v1.33.0-sandbox", "containerRuntimeVersion": "sandbox://0", "operatingSystem": "linux", "architecture": "amd64"},
                "addresses": [{"type": "Hostname", "address": name}],
            },
        }
        return self.store.create("nodes", node)

    def _simulated(self, node_name: str | None) -> Obj | None:
        if not node_name:
            return None
        with contextlib.suppress(ApiError):
            node = self.store.get("nodes", None, node_name)
            if node["metadata"].get("labels", {}).get("sandbox.kai-isolator.io/simulated") == "true":
                return node
        return None

    # --- admission: what KAI's own webhook adds -----------------------------------------

    def kai_admit(self, pod: Obj) -> Obj:
        """Mutate a GPU-sharing pod as KAI's gpusharing + hamicore admission plugins do."""
        if not is_gpu_sharing(pod):
            return pod
        target = fraction_container(pod)
        if target is None:
            raise ApiError(400, f"container with name {pod['metadata'].get('annotations', {}).get(FRACTION_CONTAINER_ANNOTATION)} not found for fraction request")
        container, index = target
        annotations = pod["metadata"].setdefault("annotations", {})
        base = (pod["metadata"].get("name") or pod["metadata"].get("generateName") or "pod").rstrip("-")[:40]
        prefix = annotations.setdefault(CONFIGMAP_ANNOTATION, f"{base}-{_random_suffix()}-shared-gpu")
        env = [e for e in container.get("env") or [] if e.get("name") not in (LIMIT_ENV, DEVICES_ENV)]
        env.append({"name": LIMIT_ENV, "valueFrom": {"configMapKeyRef": {"name": f"{prefix}-{index}", "key": LIMIT_ENV, "optional": True}}})
        # gpusharing's: the GPU the reservation pod holds, not optional (the container waits for it).
        env.append({"name": DEVICES_ENV, "valueFrom": {"configMapKeyRef": {"name": f"{prefix}-{index}", "key": DEVICES_ENV}}})
        container["env"] = env
        return pod

    # --- the pod lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        self._stream = self.store.watch("pods", None, None, None, "0")
        self._task = asyncio.create_task(self._follow(), name="sandbox-node-simulator")

    async def stop(self) -> None:
        if self._stream is not None:
            self.store.unwatch(self._stream)
        for task in [self._task, *self._timers]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._timers.clear()

    async def _follow(self) -> None:
        assert self._stream is not None
        while True:
            item = await self._stream.queue.get()
            if item is None:
                return
            kind, pod = item
            if kind != "DELETED":
                self._react(pod)

    def _react(self, pod: Obj) -> None:
        spec, status = pod.get("spec", {}), pod.get("status", {})
        phase = status.get("phase")
        node_name = spec.get("nodeName") or None
        if node_name is None and phase == "Pending":
            wanted = (spec.get("nodeSelector") or {}).get(HOSTNAME_LABEL)
            if self._simulated(wanted):
                self._later(self.step_s, pod, lambda p: self._bind(p, wanted))
        elif node_name and phase == "Pending" and self._simulated(node_name) and not status.get("startTime"):
            self._later(self.step_s, pod, self._run)
        elif phase == "Running" and RUN_SECONDS_ANNOTATION in (pod["metadata"].get("annotations") or {}) and self._simulated(node_name):
            try:
                seconds = float(pod["metadata"]["annotations"][RUN_SECONDS_ANNOTATION])
            except ValueError:
                seconds = 0.0
            self._later(max(seconds, 0.0), pod, self._exit_from_annotation)

    def _later(self, delay: float, pod: Obj, action: Callable[[Obj], None]) -> None:
        meta = pod["metadata"]
        version = meta["resourceVersion"]

        async def fire() -> None:
            await asyncio.sleep(delay)
            try:
                current = self.store.get("pods", meta["namespace"], meta["name"])
                # A newer write already moved the pod on (or a new pod took the name): nothing to do.
                if current["metadata"]["uid"] == meta["uid"] and current["metadata"]["resourceVersion"] == version:
                    action(current)
            except ApiError as error:
                log.debug("simulated step skipped", extra={"pod": meta["name"], "error": error.message})

        task = asyncio.create_task(fire())
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    def _bind(self, pod: Obj, node_name: str) -> None:
        """What KAI's binder does: PreBind writes the limit into the pod's ConfigMap, then binds."""
        self._write_limit_configmap(pod, node_name)
        bound = {**pod, "spec": {**pod["spec"], "nodeName": node_name}}
        conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now_iso()}]
        bound["status"] = {**pod["status"], "conditions": conditions}
        self.store.update("pods", pod["metadata"]["namespace"], pod["metadata"]["name"], bound, allow_spec_change=True)
        self._event(pod, "Scheduled", f"Successfully assigned {pod['metadata']['namespace']}/{pod['metadata']['name']} to {node_name}", "sandbox-scheduler")

    def bind(self, namespace: str, name: str, node_name: str) -> Obj:
        """The `pods/binding` subresource: bind now, with the same ConfigMap write."""
        pod = self.store.get("pods", namespace, name)
        if pod["spec"].get("nodeName"):
            raise ApiError(409, f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
        self._bind(pod, node_name)
        return self.store.get("pods", namespace, name)

    def _write_limit_configmap(self, pod: Obj, node_name: str) -> None:
        if not is_gpu_sharing(pod):
            return
        annotations = pod["metadata"].get("annotations") or {}
        target = fraction_container(pod)
        node = self._simulated(node_name)
        if target is None or node is None or CONFIGMAP_ANNOTATION not in annotations:
            return
        try:
            label = int(node["metadata"]["labels"].get(GPU_MEMORY_LABEL, "0"))
        except ValueError:
            label = 0
        data = {"GPU_PORTION": scheduler_portion(annotations, label) or "0.00", DEVICES_ENV: fake_gpu_uuid(0)}
        limit = kai_memory_limit(annotations, label)
        if limit is not None:
            data[LIMIT_ENV] = limit
        name = f"{annotations[CONFIGMAP_ANNOTATION]}-{target[1]}"
        owner = [{"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]
        with contextlib.suppress(ApiError):
            self.store.delete("configmaps", pod["metadata"]["namespace"], name)
        self.store.create("configmaps", {"metadata": {"name": name, "ownerReferences": owner}, "data": data}, pod["metadata"]["namespace"])

    def _run(self, pod: Obj) -> None:
        started = now_iso()
        statuses = [
            {"name": c["name"], "ready": True, "started": True, "restartCount": 0, "image": c["image"], "imageID": f"sandbox://{c['image']}",
             "containerID": f"sandbox://{pod['metadata']['uid']}/{c['name']}", "state": {"running": {"startedAt": started}}}
            for c in pod["spec"]["containers"]
        ]
        conditions = [{"type": t, "status": "True", "lastTransitionTime": started} for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        status = {**pod["status"], "phase": "Running", "startTime": started, "hostIP": "10.0.0.1", "podIP": "10.244.0.10", "conditions": conditions, "containerStatuses": statuses}
        self.store.update("pods", pod["metadata"]["namespace"], pod["metadata"]["name"], {**pod, "status": status})
        self._event(pod, "Started", "Started simulated containers", "sandbox-kubelet")

    def _exit_from_annotation(self, pod: Obj) -> None:
        try:
            code = int((pod["metadata"].get("annotations") or {}).get(EXIT_CODE_ANNOTATION, "0"))
        except ValueError:
            code = 1
        self._terminate(pod, code)

    def finish(self, namespace: str, name: str, exit_code: int = 0) -> Obj:
        """End a running pod's containers now: Succeeded on 0, Failed otherwise."""
        pod = self.store.get("pods", namespace, name)
        if pod["status"].get("phase") != "Running":
            raise ApiError(409, f"pod {name} is {pod['status'].get('phase')}, not Running")
        self._terminate(pod, exit_code)
        return self.store.get("pods", namespace, name)

    def _terminate(self, pod: Obj, exit_code: int) -> None:
        finished = now_iso()
        statuses = []
        for status in pod["status"].get("containerStatuses") or []:
            started = (status.get("state", {}).get("running") or {}).get("startedAt", finished)
            terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "startedAt": started, "finishedAt": finished}
            statuses.append({**status, "ready": False, "started": False, "state": {"terminated": terminated}})
        phase = "Succeeded" if exit_code == 0 else "Failed"
        status = {**pod["status"], "phase": phase, "containerStatuses": statuses}
        self.store.update("pods", pod["metadata"]["namespace"], pod["metadata"]["name"], {**pod, "status": status})

    def _event(self, pod: Obj, reason: str, message: str, component: str) -> None:
        meta = pod["metadata"]
        event = {
            "metadata": {"generateName": f"{meta['name']}."},
            "involvedObject": {"kind": "Pod", "namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"], "apiVersion": "v1"},
            "reason": reason, "message": message, "type": "Normal", "source": {"component": component},
            "firstTimestamp": now_iso(), "lastTimestamp": now_iso(), "count": 1,
        }
        with contextlib.suppress(ApiError):
            self.store.create("events", event, meta["namespace"])

    def status(self) -> dict[str, Any]:
        return {"pending_timers": len(self._timers)}
