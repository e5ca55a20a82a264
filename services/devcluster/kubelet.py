"""A simulated GPU node's kubelet on the local control plane: registers the Node, "runs" its pods, reports their status.

It holds the node's own credentials (system:node:<name>), so the Node authorizer decides what it may write,
and it watches only the pods bound to it, as a kubelet does. A DEV AND TEST FIXTURE: no container runs.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from .api import STRATEGIC_MERGE_PATCH, AsyncApi
from .kai import GPU_MEMORY_LABEL, HOSTNAME_LABEL, SIMULATED_LABEL
from .plane import ApiCallError

log = logging.getLogger(__name__)

Obj = dict[str, Any]
# How long a simulated container runs and how it ends; absent = runs until deleted.
RUN_SECONDS_ANNOTATION = "devcluster.kai-isolator.io/run-seconds"
EXIT_CODE_ANNOTATION = "devcluster.kai-isolator.io/exit-code"
STEP_RETRY_S = 60.0


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_object(name: str, gpu_memory_mib: int, gpus: int = 1) -> Obj:
    capacity = {"cpu": "16", "memory": "128Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    labels = {HOSTNAME_LABEL: name, GPU_MEMORY_LABEL: str(gpu_memory_mib), "nvidia.com/gpu.count": str(gpus), SIMULATED_LABEL: "true"}
    return {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
        "status": {
            "capacity": capacity, "allocatable": capacity, "addresses": [{"type": "Hostname", "address": name}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated node",
                            "lastHeartbeatTime": now_iso(), "lastTransitionTime": now_iso()}],
            "nodeInfo": {"kubeletVersion": "v1.37.2-devcluster", "containerRuntimeVersion": "devcluster://0", "operatingSystem": "linux",
                         "architecture": "amd64", "bootID": str(uuid.uuid4()), "machineID": uuid.uuid4().hex, "systemUUID": str(uuid.uuid4()),
                         "kernelVersion": "", "osImage": "", "kubeProxyVersion": ""},
        },
    }


def running_status(pod: Obj) -> Obj:
    started = now_iso()
    statuses = [{"name": c["name"], "ready": True, "started": True, "restartCount": 0, "image": c["image"],
                 "imageID": f"devcluster://{c['image']}", "containerID": f"containerd://{pod['metadata']['uid'].replace('-', '')}{i:02d}",
                 "state": {"running": {"startedAt": started}}} for i, c in enumerate(pod["spec"]["containers"])]
    conditions = [{"type": t, "status": "True", "lastTransitionTime": started} for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
    return {"phase": "Running", "startTime": started, "hostIP": "10.0.0.10", "podIP": "10.244.0.10",
            "conditions": conditions, "containerStatuses": statuses}


def finished_status(pod: Obj, exit_code: int) -> Obj:
    finished = now_iso()
    statuses = []
    for status in pod["status"].get("containerStatuses") or []:
        started = (status.get("state", {}).get("running") or {}).get("startedAt", finished)
        terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "startedAt": started, "finishedAt": finished}
        statuses.append({**status, "ready": False, "started": False, "state": {"terminated": terminated}})
    return {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": statuses}


NODE_GRAPH_LAG = "no relationship found between node"
"""The Node authorizer's refusal while its graph, fed by its own watch, has not yet seen the pod bound to the node."""


def _transient(error: ApiCallError) -> bool:
    """An answer a later try can change: the server loaded or restarting, or its Node authorizer behind the binding
    (seen under load: the kubelet's watch delivered the bound pod before the authorizer's graph had it)."""
    return error.code >= 500 or error.code == 429 or (error.code == 403 and NODE_GRAPH_LAG in str(error.status.get("message", "")))


class SimulatedKubelet:
    """One simulated GPU node: Pending -> Running after `step_s`, then Succeeded/Failed by annotation or `finish()`."""

    def __init__(self, api: AsyncApi, name: str, gpu_memory_mib: int = 15360, step_s: float = 0.2) -> None:
        self.api, self.name, self.gpu_memory_mib, self.step_s = api, name, gpu_memory_mib, step_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._informer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await self.api.request("POST", "/api/v1/nodes", node_object(self.name, self.gpu_memory_mib))
        except ApiCallError as error:
            if error.code != 409:  # registered by an earlier run of this node: keep it
                raise
        self._informer = asyncio.create_task(self.api.informer(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.name}", self._on_pod),
                                             name=f"devcluster-kubelet-{self.name}")

    async def stop(self) -> None:
        tasks = [t for t in [self._informer, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, action: Any) -> None:
        task = asyncio.create_task(action)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("simulated kubelet %s: a step failed: %r", self.name, task.exception())

    async def _on_pod(self, kind: str, pod: Obj) -> None:
        if kind == "DELETED":
            return
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp"):
            self._spawn(self._confirm_deletion(pod))
        elif status.get("phase") == "Pending" and not status.get("startTime"):
            self._spawn(self._run_later(pod))
        elif status.get("phase") == "Running" and RUN_SECONDS_ANNOTATION in (pod["metadata"].get("annotations") or {}):
            self._spawn(self._exit_later(pod))

    async def _current(self, pod: Obj) -> Obj | None:
        """The pod as the API server has it now; None once it is gone (or its name is another pod's)."""
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        current = await self._until_answered("GET", path, lambda: self.api.request("GET", path))
        return current if current is not None and current["metadata"]["uid"] == meta["uid"] else None

    async def _patch_status(self, pod: Obj, status: Obj) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        await self._until_answered("PATCH", path, lambda: self.api.request("PATCH", path, {"status": status}, content_type=STRATEGIC_MERGE_PATCH))

    async def _until_answered(self, method: str, path: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """A call retried through a loaded or restarting API server, as a kubelet's status manager keeps
        retrying: a step dropped on one failed call would leave the pod Pending for ever. None on 404
        (deleted meanwhile: a kubelet stops reporting too); a refusal at once; the last error once
        STEP_RETRY_S is spent."""
        deadline = asyncio.get_running_loop().time() + STEP_RETRY_S
        delay = 0.1
        while True:
            try:
                return await call()
            except ApiCallError as error:
                if error.code == 404:
                    return None
                if not _transient(error):
                    raise  # a refusal, not a hiccup: retrying would only repeat it
                failure: Exception = error
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                failure = error
            if asyncio.get_running_loop().time() + delay > deadline:
                raise failure
            log.info("simulated kubelet %s: %s %s failed, retrying: %s", self.name, method, path, failure)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _run_later(self, pod: Obj) -> None:
        await asyncio.sleep(self.step_s)
        current = await self._current(pod)
        if current is not None and current["status"].get("phase") == "Pending" and not current["status"].get("startTime"):
            await self._patch_status(current, running_status(current))

    async def _exit_later(self, pod: Obj) -> None:
        annotations = pod["metadata"].get("annotations") or {}
        try:
            seconds = max(float(annotations[RUN_SECONDS_ANNOTATION]), 0.0)
        except ValueError:
            seconds = 0.0
        await asyncio.sleep(seconds)
        current = await self._current(pod)
        if current is None or current["status"].get("phase") != "Running":
            return
        try:
            code = int(annotations.get(EXIT_CODE_ANNOTATION, "0"))
        except ValueError:
            code = 1
        await self._patch_status(current, finished_status(current, code))

    async def finish(self, namespace: str, name: str, exit_code: int = 0) -> None:
        """End a running pod's containers now: Succeeded on 0, Failed otherwise."""
        pod = await self.api.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        await self._patch_status(pod, finished_status(pod, exit_code))

    async def _confirm_deletion(self, pod: Obj) -> None:
        """What the kubelet does once a deleted pod's containers have stopped: delete it for good."""
        meta = pod["metadata"]
        try:
            # With a body the API server reads the options from it alone (a query string would be ignored).
            await self.api.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                   {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except ApiCallError as error:
            if error.code != 404:  # gone already: what was wanted
                raise
