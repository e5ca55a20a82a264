"""`DevCluster`: the real etcd + kube-apiserver with simulated KAI-Scheduler and GPU nodes, for `make run`, the demo and tests.

Everything goes through the real API: KAI's admission is a registered webhook, binding is the `binding` subresource,
the kubelets hold node credentials. Only KAI-Scheduler and the kubelet are simulated. A DEV AND TEST FIXTURE.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO
from urllib.parse import quote

from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.settings import split_host_port

from .api import MERGE_PATCH, AsyncApi
from .build import BuildError, ensure_all
from .kai import GPU_SHARING_CONDITION, LIMIT_ENV, KaiAdmission, KaiScheduler
from .kubelet import SimulatedKubelet
from .plane import ApiCallError, ControlPlane, ControlPlaneError

log = logging.getLogger(__name__)
# Ours matches updates too (the GPU-request annotations are fixed once a pod exists), so the pod before one counts; and
# at creation a pod outside GPU sharing that names GPUs for the NVIDIA runtime (its policy refuses or warns), as deploy/ has it.
_NAMES_GPUS = "c.env.exists(e, e.name == 'NVIDIA_VISIBLE_DEVICES' && !(has(e.value) && e.value in ['void', 'none']))"
OUR_MATCH_CONDITION = {
    "name": "gpu-sharing-or-gpu-naming-pods",
    "expression": f"({GPU_SHARING_CONDITION['expression']}) || (oldObject != null && has(oldObject.metadata.annotations) && "
                  "('gpu-fraction' in oldObject.metadata.annotations || 'gpu-memory' in oldObject.metadata.annotations)) || "
                  "(request.operation == 'CREATE' && has(object.spec.containers) && "
                  f"(object.spec.containers.exists(c, has(c.env) && {_NAMES_GPUS}) || "
                  f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, has(c.env) && {_NAMES_GPUS}))))",
}

Obj = dict[str, Any]
WEBHOOK_NAME = "kai-resource-isolator"
OPT_OUT_LABEL = "kai-resource-isolator.io/webhook"
NAMESPACE_OPT_OUT = {"matchExpressions": [{"key": OPT_OUT_LABEL, "operator": "NotIn", "values": ["ignore"]}]}
# Where dry-run probes show a new webhook configuration is in force: KAI's alone, and ours.
PROBE_NAMESPACE = "kai-isolator-devcluster-probe"
WEBHOOK_PROBE_NAMESPACE = "kai-isolator-devcluster"
_GROUPS = {"mutatingwebhookconfigurations": "/apis/admissionregistration.k8s.io/v1", "leases": "/apis/coordination.k8s.io/v1",
           "runtimeclasses": "/apis/node.k8s.io/v1"}
_CLUSTER_SCOPED = {"nodes", "namespaces", "mutatingwebhookconfigurations", "runtimeclasses"}


def resource_path(plural: str, namespace: str | None = None, name: str | None = None, subresource: str = "") -> str:
    """The REST path of a collection or an object: `pods` in `default` is /api/v1/namespaces/default/pods."""
    path = _GROUPS.get(plural, "/api/v1")
    if namespace and plural not in _CLUSTER_SCOPED:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    return path + (f"/{subresource}" if subresource else "")


class DevCluster:
    """Start with `async with DevCluster(...)`; `kubeconfig` is the admin's; `create`/`get`/`patch`/`delete` are REST calls."""

    def __init__(self, *, workdir: Path | None = None, nodes: dict[str, int] | None = None, step_s: float = 0.2,
                 listen: str = "127.0.0.1:0", server_name: str | None = None, build_log: TextIO = sys.stderr,
                 plane: ControlPlane | None = None) -> None:
        """`plane`: an already running control plane to use (tests share one per session); stop() then empties it instead."""
        self.nodes = {"gpu-node-1": 15360} if nodes is None else nodes
        self.step_s = step_s
        self._listen, self._server_name, self._build_log = listen, server_name, build_log
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="kai-isolator-devcluster-")) if workdir is None else Path(workdir)
        self.plane: ControlPlane | None = plane
        self._shared_plane = plane is not None
        self.api: AsyncApi | None = None
        self.kubelets: dict[str, SimulatedKubelet] = {}
        self.kai_admission = KaiAdmission(self.workdir / "kai")
        self.scheduler: KaiScheduler | None = None
        self._stopped_scheduler: KaiScheduler | None = None
        self.startup_s: dict[str, float] = {}

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> DevCluster:
        started = time.monotonic()
        if self.plane is None:
            self.plane = await self._new_plane()
        try:
            if not self._shared_plane:
                await asyncio.to_thread(self.plane.start)
                self.startup_s.update(self.plane.startup_s)
            self.api = AsyncApi(self.plane.url, self.plane.workdir / "ca.crt", self.plane.workdir / "admin.crt", self.plane.workdir / "admin.key")
            await self.ensure_namespace("default")
            # KAI's admission gives GPU-sharing pods the `nvidia` runtime class, which a GPU Operator cluster defines.
            if self.kai_admission.options.runtime_class:
                await self.ensure_runtime_class(self.kai_admission.options.runtime_class)
            await self.kai_admission.start()
            await self.api.request("POST", resource_path("mutatingwebhookconfigurations"), self.kai_admission.configuration())
            await self.ensure_namespace(PROBE_NAMESPACE, {OPT_OUT_LABEL: "ignore"})
            await self._until_admitted(PROBE_NAMESPACE, lambda pod: any(e["name"] == LIMIT_ENV for e in pod["spec"]["containers"][0].get("env") or []),
                                       "KAI's admission")
            for name, memory in self.nodes.items():
                await self.add_node(name, memory)
            self.scheduler = KaiScheduler(self.api, self.nodes, self.step_s)
            self.scheduler.start()
        except BaseException:
            await self.stop()
            raise
        self.startup_s["total"] = time.monotonic() - started
        log.info("local control plane ready", extra={"url": self.plane.url, "seconds": round(self.startup_s["total"], 2)})
        return self

    async def _new_plane(self) -> ControlPlane:
        started = time.monotonic()
        try:
            binaries = await asyncio.to_thread(ensure_all, self._build_log)
        except BuildError as error:
            raise ConfigError(f"the local control plane could not be built: {error}") from None
        self.startup_s["build cache"] = time.monotonic() - started
        host, port = split_host_port(self._listen)
        hosts = (self._server_name,) if self._server_name else ()
        return ControlPlane(binaries, self.workdir / "plane", bind_address=host, port=port, hosts=hosts)

    async def add_node(self, name: str, gpu_memory_mib: int = 15360) -> SimulatedKubelet:
        """Register one more simulated GPU node, with its kubelet's own credentials."""
        assert self.plane is not None
        cert, key = self.plane.node_credentials(name)
        kubelet = SimulatedKubelet(AsyncApi(self.plane.url, self.plane.workdir / "ca.crt", cert, key), name, gpu_memory_mib, self.step_s)
        await kubelet.start()
        self.kubelets[name] = kubelet
        self.nodes[name] = gpu_memory_mib
        return kubelet

    async def stop_simulated_kai(self) -> None:
        """Take the simulated KAI away (its admission's registration, its scheduler), so the real one can run here."""
        if self.scheduler is not None:
            await self.scheduler.stop()
            self._stopped_scheduler = self.scheduler
            self.scheduler = None
        name = self.kai_admission.configuration()["metadata"]["name"]
        with contextlib.suppress(ApiCallError):
            await self.request("DELETE", resource_path("mutatingwebhookconfigurations", None, name))

    async def start_simulated_kai(self) -> None:
        """Put the simulated KAI back after `stop_simulated_kai`, with the nodes it knew, in force before this returns."""
        name = self.kai_admission.configuration()["metadata"]["name"]
        with contextlib.suppress(ApiCallError):
            await self.request("DELETE", resource_path("mutatingwebhookconfigurations", None, name))
        await self.request("POST", resource_path("mutatingwebhookconfigurations"), self.kai_admission.configuration())
        await self._until_admitted(PROBE_NAMESPACE, lambda pod: any(e["name"] == LIMIT_ENV for e in pod["spec"]["containers"][0].get("env") or []),
                                   "KAI's admission")
        assert self.api is not None and self._stopped_scheduler is not None
        self.scheduler = KaiScheduler(self.api, self._stopped_scheduler.nodes, self.step_s, self._stopped_scheduler.options)
        self.scheduler.only_kai_pods = self._stopped_scheduler.only_kai_pods
        self.scheduler.start()

    async def stop(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()
        for kubelet in self.kubelets.values():
            await kubelet.stop()
            await kubelet.api.close()
        await self.kai_admission.stop()
        if self._shared_plane and self.api is not None:
            await self._empty()
        if self.api is not None:
            await self.api.close()
        if self.plane is not None and not self._shared_plane:
            await asyncio.to_thread(self.plane.stop)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def _empty(self) -> None:
        """Leave a shared control plane as the next user expects it: no pods, nodes, webhooks or namespaced leftovers."""
        now = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
        for namespace in await self.list("namespaces"):
            for plural in ("pods", "configmaps", "events"):
                with contextlib.suppress(ApiCallError):
                    await self.request("DELETE", resource_path(plural, namespace["metadata"]["name"]), now)
        for plural in ("mutatingwebhookconfigurations", "nodes"):
            with contextlib.suppress(ApiCallError):
                await self.request("DELETE", resource_path(plural), now)

    async def __aenter__(self) -> DevCluster:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        assert self.plane is not None, "start the cluster first"
        return self.plane.url

    @property
    def kubeconfig(self) -> Path:
        assert self.plane is not None, "start the cluster first"
        return self.plane.admin_kubeconfig

    def write_kubeconfig(self, path: Path, server: str | None = None) -> Path:
        """The admin kubeconfig at `path`, naming the server as `server` (default: its loopback URL)."""
        assert self.plane is not None, "start the cluster first"
        return self.plane.write_kubeconfig(Path(path), "admin", self.plane.admin_user(), server=server)

    # --- REST as the admin ----------------------------------------------------------------

    async def request(self, method: str, path: str, body: Any = None, **options: Any) -> Any:
        assert self.api is not None, "start the cluster first"
        return await self.api.request(method, path, body, **options)

    async def create(self, plural: str, body: Obj, namespace: str | None = None) -> Obj:
        namespace = namespace or (body.get("metadata") or {}).get("namespace") or "default"
        kind = {"pods": "Pod", "configmaps": "ConfigMap", "events": "Event", "namespaces": "Namespace", "nodes": "Node"}.get(plural)
        body = {**({"apiVersion": "v1", "kind": kind} if kind else {}), **body}
        return await self.request("POST", resource_path(plural, namespace), body)  # type: ignore[no-any-return]

    async def get(self, plural: str, namespace: str | None, name: str) -> Obj:
        return await self.request("GET", resource_path(plural, namespace, name))  # type: ignore[no-any-return]

    async def list(self, plural: str, namespace: str | None = None, label_selector: str | None = None) -> list[Obj]:
        query = f"?labelSelector={quote(label_selector)}" if label_selector else ""
        return (await self.request("GET", resource_path(plural, namespace) + query))["items"]  # type: ignore[no-any-return]

    async def patch(self, plural: str, namespace: str | None, name: str, patch: Any, *, content_type: str = MERGE_PATCH,
                    subresource: str = "") -> Obj:
        return await self.request("PATCH", resource_path(plural, namespace, name, subresource), patch,  # type: ignore[no-any-return]
                                  content_type=content_type)

    async def delete(self, plural: str, namespace: str | None, name: str, *, grace_period_s: int | None = None) -> Obj:
        query = f"?gracePeriodSeconds={grace_period_s}" if grace_period_s is not None else ""
        return await self.request("DELETE", resource_path(plural, namespace, name) + query)  # type: ignore[no-any-return]

    async def wait_gone(self, plural: str, namespace: str | None, name: str, timeout_s: float = 10) -> None:
        """Wait until the object answers 404: a bound pod's deletion is graceful, it stays (with a deletionTimestamp)
        until its node's kubelet confirms that the containers stopped."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.get(plural, namespace, name)
            except ApiCallError as error:
                if error.code == 404:
                    return
                raise
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{plural} {namespace}/{name} still there after {timeout_s:.0f}s")
            await asyncio.sleep(0.02)

    async def ensure_runtime_class(self, name: str, handler: str | None = None) -> None:
        body = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": name}, "handler": handler or name}
        try:
            await self.request("POST", resource_path("runtimeclasses"), body)
        except ApiCallError as error:
            if error.code != 409:
                raise

    async def ensure_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """A namespace and its `default` ServiceAccount (which the absent controller-manager would create)."""
        for plural, body, namespace in (("namespaces", {"metadata": {"name": name, "labels": labels or {}}}, None),
                                        ("serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}, name)):
            try:
                await self.create(plural, body, namespace)
            except ApiCallError as error:
                if error.code != 409:
                    raise
        if labels:
            await self.patch("namespaces", None, name, {"metadata": {"labels": labels}})

    async def finish(self, namespace: str, name: str, exit_code: int = 0) -> None:
        """End a running pod's containers now, as its node would: Succeeded on 0, Failed otherwise."""
        pod = await self.get("pods", namespace, name)
        await self.kubelets[pod["spec"]["nodeName"]].finish(namespace, name, exit_code)

    async def unregister_webhook(self, name: str = WEBHOOK_NAME) -> None:
        """Our webhook's registration gone: left behind a stopped webhook, failurePolicy Fail would refuse every
        GPU-sharing pod the cluster gets afterwards."""
        with contextlib.suppress(ApiCallError):  # 404: not registered
            await self.request("DELETE", resource_path("mutatingwebhookconfigurations", None, name))

    async def register_webhook(self, url: str, ca_bundle_pem: bytes | str, *, name: str = WEBHOOK_NAME, failure_policy: str = "Ignore",
                               timeout_s: int = 5) -> Obj:
        """Register our pod webhook (CREATE, UPDATE) at `url` as deploy/ does: GPU-sharing pods only, namespaces may opt out."""
        pem = ca_bundle_pem.encode() if isinstance(ca_bundle_pem, str) else ca_bundle_pem
        hook: Obj = {
            "name": f"{name}.kai-isolator.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "clientConfig": {"url": url, "caBundle": base64.b64encode(pem).decode()},
            "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced"}],
            "failurePolicy": failure_policy, "timeoutSeconds": timeout_s, "reinvocationPolicy": "IfNeeded",
            "namespaceSelector": NAMESPACE_OPT_OUT, "matchConditions": [OUR_MATCH_CONDITION],
        }
        body = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration", "metadata": {"name": name}, "webhooks": [hook]}
        await self.unregister_webhook(name)
        created: Obj = await self.request("POST", resource_path("mutatingwebhookconfigurations"), body)
        await self.ensure_namespace(WEBHOOK_PROBE_NAMESPACE)
        await self._until_admitted(WEBHOOK_PROBE_NAMESPACE, lambda pod: any(v["name"] == "kai-resource-isolator-vgpu" for v in pod["spec"].get("volumes") or []),
                                   f"webhook {name}")
        return created

    async def _until_admitted(self, namespace: str, admitted: Any, what: str, timeout_s: float = 20) -> None:
        """Wait until a newly registered webhook is in force: the API server picks configurations up from a watch, not at
        once, and a pod created before then would never meet it. Probed with dry-run creates (nothing is stored)."""
        # A seccomp profile, so a webhook under --policy enforce admits the probe too.
        probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "webhook-probe", "annotations": {"gpu-memory": "1024"}},
                 "spec": {"schedulerName": "kai-scheduler", "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                          "containers": [{"name": "main", "image": "busybox"}]}}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pod = await self.request("POST", resource_path("pods", namespace) + "?dryRun=All", probe)
                if admitted(pod):
                    return
            except ApiCallError as error:
                if error.code < 500:
                    raise
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{what} still not in force {timeout_s:.0f}s after its registration")
            await asyncio.sleep(0.05)

    # --- faults the tests need ------------------------------------------------------------

    async def restart_apiserver(self) -> None:
        assert self.plane is not None
        await asyncio.to_thread(self.plane.restart_apiserver)

    async def compact(self) -> int:
        """Compact etcd's history up to now. Older resourceVersions answer 410 Gone once kube-apiserver's watch cache no
        longer holds them too (after a restart of it, say): compaction alone leaves recent ones served from the cache."""
        assert self.plane is not None
        return await asyncio.to_thread(self.plane.compact_etcd)


__all__ = ["ApiCallError", "ControlPlaneError", "DevCluster", "resource_path"]
