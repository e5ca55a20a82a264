"""Per-container grants for every GPU-sharing pod bound to this node: the pods watched from the API, each grant
computed (grant_decision.py) and written (grant_files.py), and every decision published. The same watch brings KAI's
reservation pods on this node, which say which GPU each GPU group holds.

The tenant can edit the ConfigMap in its namespace, so the grant takes the smaller of the two values and
says why; a grant once written is never raised. Missing or invalid inputs mean no grant (libvgpu.so then
fails closed, and the enforcer holds the container to nothing) and a published reason, also written on
the pod as a `GrantWithheld` Event.

Every other pod on the node is kept too, by name and container ids only: the enforcer holds their containers to
nothing on a GPU that KAI shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException

from kai_isolator.shared.contract import (
    FRACTION_CONTAINER_ANNOTATION, LIMIT_ENV, RESERVATION_NAMESPACE, is_gpu_sharing,
)
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.events import GrantDecision, PodRef, Reason
from kai_isolator.shared.grant import GPU_MEMORY_NODE_LABEL, Grant

from .grant_decision import (
    DEVICES_ENV, Decision, EnvRef, Inputs, Obj, decide, env_ref, held_by_group, never_raised, reservation, target_container,
)
from .grant_files import collect_stale, read_grant, remove_grants, write_grant

log = logging.getLogger(__name__)

_TIMEOUT = aiohttp.ClientTimeout(total=30)
DEPARTED_GRACE_S = 60.0
"""How long a pod deleted from the API is still known by its containers: one force-deleted (`--grace-period=0`) is gone
from the API while the kubelet is still stopping its containers, and what they hold on a shared GPU is no grant holder's."""
_STATUS_LISTS = ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses")


def slim_pod(pod: Obj) -> Obj:
    """What the enforcer needs of a pod outside GPU sharing: its name, and its containers' names by runtime id."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    return {"metadata": {key: meta.get(key) for key in ("namespace", "name", "uid")},
            "status": {key: [{"name": s.get("name"), "containerID": s.get("containerID")} for s in status.get(key) or [] if isinstance(s, dict)]
                       for key in _STATUS_LISTS}}


# --- the pod source ---------------------------------------------------------------------


async def api_client(kubeconfig: Path | None) -> client.ApiClient | None:
    """A client from the kubeconfig, else the in-cluster service account; None outside a cluster without one."""
    configuration = client.Configuration()
    try:
        if kubeconfig is not None:
            await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration, persist_config=False)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            return None
    except (ConfigException, OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as error:
        # A kubeconfig that is not YAML or not a kubeconfig fails in the loader in any of these ways.
        raise ConfigError(f"the node agent reads pods to write grants and cannot load a Kubernetes client configuration: {error}") from None
    return client.ApiClient(configuration)


Publish = Callable[[GrantDecision], Awaitable[None]]
OnWithheld = Callable[[PodRef, str, str, str], Awaitable[None]]
"""(pod, container, the reasons in one line, a key naming this decision): told once per distinct withheld decision."""


@dataclass
class _Tracked:
    pod: Obj
    published: set[str] = field(default_factory=set)
    fingerprint: str = ""  # what the grant depends on in the pod: its annotations and the target's env
    settled: str = ""  # the fingerprint a grant was last written or kept for: status changes need no new reads


class GrantKeeper:
    """Lists and watches the pods bound to one node and keeps their grants on disk: written as soon as the
    pod is bound and its ConfigMap exists, retried while an input is missing, removed when the pod is deleted."""

    def __init__(self, api: client.ApiClient, node: str, root: Path, publish: Publish, *, retry_s: float = 2.0,
                 watch_timeout_s: int = 300, read_timeout_s: float = 90.0, backoff_max_s: float = 10.0, stale_grace_s: float = 60.0,
                 on_withheld: OnWithheld | None = None, reservation_namespace: str = RESERVATION_NAMESPACE) -> None:
        self.core = client.CoreV1Api(api)
        self.node = node
        self.reservation_namespace = reservation_namespace
        self.reservations: dict[str, tuple[str, str]] = {}  # reservation pod uid -> (GPU group, the UUID it wrote)
        self.root = root
        self.publish = publish
        self.on_withheld = on_withheld
        self.withheld: dict[tuple[str, str], str] = {}  # (pod uid, container) -> why it has no grant (the enforcer says it)
        self.retry_s = retry_s
        self.watch_timeout_s = watch_timeout_s
        self.read_timeout_s = read_timeout_s
        self.backoff_max_s = backoff_max_s
        self.stale_grace_s = stale_grace_s
        self.pods: dict[str, _Tracked] = {}
        # Pod uid -> every other pod bound to the node (slim_pod), KAI's reservation pods apart; one deleted stays
        # DEPARTED_GRACE_S. Read from the enforcer's worker thread by key only: replaced, never iterated there.
        self.others: dict[str, Obj] = {}
        self._departed: dict[str, float] = {}  # pod uid -> when it left the API
        self.waiting: set[str] = set()
        self.synced = asyncio.Event()
        self._api = api
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        await self._api.close()

    def shared_gpus(self) -> frozenset[str]:
        """The GPUs that KAI's reservation pods on this node hold (their UUIDs, as their programs wrote them)."""
        return frozenset(device for _, device in list(self.reservations.values()))

    # --- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """List, then watch from the listed version; relist on 410; back off on API failures. Runs until cancelled."""
        retries = asyncio.create_task(self._retry_waiting(), name="grant-retries")
        delay, version = 0.2, None
        try:
            while True:
                try:
                    if version is None:
                        version = await self._relist()
                    version = await self._watch(version)
                    delay = 0.2
                except ApiException as error:
                    if error.status == 410:
                        version = None
                        continue
                    log.warning("Kubernetes API error while watching pods for grants", extra={"node": self.node, "status": error.status, "error": error.reason})
                    version = None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.backoff_max_s)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                    log.warning("Kubernetes API unavailable while watching pods for grants", extra={"node": self.node, "error": repr(error)})
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.backoff_max_s)
                except Exception:  # noqa: BLE001 - a bug on one pod must not stop grants for the others: relist
                    log.exception("grant keeping failed; relisting", extra={"node": self.node})
                    version = None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.backoff_max_s)
        finally:
            retries.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retries

    def _selector(self) -> str:
        return f"spec.nodeName={self.node}"

    async def _relist(self) -> str:
        listing = await self._read(self.core.list_pod_for_all_namespaces(
            field_selector=self._selector(), _preload_content=False, _request_timeout=aiohttp.ClientTimeout(total=60)))
        if listing is None:
            raise ApiException(status=404, reason="pods cannot be listed")
        live = set()
        # KAI's reservation pods first: the grants of the sharing pods listed with them depend on what they hold.
        for pod in sorted(listing.get("items") or [], key=lambda p: not self._is_reservation(p)):
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            live.add(uid)
            await self.on_pod(pod)
        for uid in [u for u in self.pods if u not in live]:
            await self.on_deleted(self.pods[uid].pod)
        for uid in [u for u in self.others if u not in live and u not in self._departed]:
            self._departed[uid] = time.monotonic()  # deleted while the watch was away
        for uid in [u for u in self.reservations if u not in live]:
            del self.reservations[uid]
        stale = await asyncio.to_thread(collect_stale, self.root, live, self.stale_grace_s)
        if stale:
            log.info("removed grants of pods no longer on this node", extra={"node": self.node, "grants": stale})
        self.synced.set()
        return str(listing["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        timeout = aiohttp.ClientTimeout(sock_connect=10, sock_read=self.read_timeout_s)
        async with watch.Watch(return_type="object") as stream:
            async for event in stream.stream(
                self.core.list_pod_for_all_namespaces, field_selector=self._selector(), resource_version=version,
                allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s, _request_timeout=timeout,
            ):
                if not isinstance(event, dict):
                    raise ApiException(status=0, reason=f"unreadable watch line: {str(event)[:200]}")
                pod = event.get("raw_object") or {}
                if event.get("type") in ("ADDED", "MODIFIED"):
                    await self.on_pod(pod)
                elif event.get("type") == "DELETED":
                    await self.on_deleted(pod)
                version = str((pod.get("metadata") or {}).get("resourceVersion") or version)
        return version

    async def _retry_waiting(self) -> None:
        while True:
            await asyncio.sleep(self.retry_s)
            self._forget_departed()
            for uid in list(self.waiting):
                tracked = self.pods.get(uid)
                if tracked is not None:
                    try:
                        await self.on_pod(tracked.pod)
                    except Exception as error:  # noqa: BLE001 - retried on the next round
                        log.warning("grant retry failed", extra={"node": self.node, "pod_uid": uid, "error": repr(error)})

    # --- one pod ----------------------------------------------------------------------

    def _is_reservation(self, pod: Obj) -> bool:
        return (pod.get("metadata") or {}).get("namespace") == self.reservation_namespace

    def _note_reservation(self, pod: Obj) -> None:
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        held = reservation(pod, self.node)
        if uid and held is not None:
            self.reservations[uid] = held
        else:
            self.reservations.pop(uid, None)

    def _forget_departed(self) -> None:
        now = time.monotonic()
        for uid in [u for u, at in self._departed.items() if now - at > DEPARTED_GRACE_S]:
            del self._departed[uid]
            self.others.pop(uid, None)

    async def on_pod(self, pod: Obj) -> None:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        annotations = meta.get("annotations") or {}
        if self._is_reservation(pod):
            self._note_reservation(pod)
            return
        if not uid or (pod.get("spec") or {}).get("nodeName") != self.node:
            return
        if not isinstance(annotations, dict) or not is_gpu_sharing(annotations):
            self.others[uid] = slim_pod(pod)
            return
        async with self._lock:
            tracked = self.pods.setdefault(uid, _Tracked(pod))
            tracked.pod = pod
            container = target_container(pod)
            tracked.fingerprint = json.dumps([annotations, container], sort_keys=True, default=str)
            if tracked.settled == tracked.fingerprint and uid not in self.waiting:
                return
            if container is None:
                self.waiting.discard(uid)
                await self._tell(tracked, GrantDecision(
                    pod=_ref(pod), node_name=self.node, container=str(annotations.get(FRACTION_CONTAINER_ANNOTATION, "")), outcome="withheld",
                    reasons=[Reason(code="no-target-container", message="the pod names no container KAI would give the GPU share")]))
                return
            try:
                inputs = await self._inputs(pod, container)
            except (ApiException, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
                # One unreadable ConfigMap (forbidden, the API away) must not hold up the other pods: retried.
                why = f"HTTP {error.status}: {error.reason}" if isinstance(error, ApiException) else repr(error)
                reason = Reason(code="inputs-unreadable", message=f"cannot read the pod's ConfigMap or its node ({why})")
                decision = Decision(str(container.get("name") or ""), None, (reason,), retry=True)
            else:
                decision = decide(pod, container, inputs)
            await self._apply(tracked, pod, decision)

    async def _apply(self, tracked: _Tracked, pod: Obj, decision: Decision) -> None:
        uid = str(pod["metadata"]["uid"])
        old = await asyncio.to_thread(_read_quietly, self.root, uid, decision.container)
        reasons = list(decision.reasons)
        grant = decision.grant
        self.waiting.discard(uid)
        if grant is None:
            if old is not None:
                # Inputs gone (a deleted or edited ConfigMap) never take back a grant already given.
                await self._tell(tracked, self._event(pod, decision, "kept", old, reasons))
                tracked.settled = tracked.fingerprint
            else:
                if decision.retry:
                    self.waiting.add(uid)
                await self._tell(tracked, self._event(pod, decision, "withheld", None, reasons))
            return
        grant, kept = never_raised(grant, old)
        if kept is not None:
            reasons.append(kept)
            await self._tell(tracked, self._event(pod, decision, "kept", grant, reasons))
            tracked.settled = tracked.fingerprint
            return
        try:
            written = await asyncio.to_thread(write_grant, self.root, grant)
        except (ConfigError, OSError) as error:
            self.waiting.add(uid)  # a full or read-only disk may recover; a bad name is reported once
            reasons.append(Reason(code="grant-write-failed", message=f"{type(error).__name__}: {error}"))
            await self._tell(tracked, self._event(pod, decision, "withheld", None, reasons))
            return
        tracked.settled = tracked.fingerprint
        if written:
            log.info("grant written", extra={"node": self.node, "pod": f"{grant.namespace}/{grant.pod}", "container": grant.container,
                                             "limit_bytes": grant.devices[0].limit_bytes, "source": grant.source.value, "reason": grant.reason})
        await self._tell(tracked, self._event(pod, decision, "written", grant, reasons))

    async def on_deleted(self, pod: Obj) -> None:
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if not uid:
            return
        self._forget_departed()
        if self._is_reservation(pod):
            self.reservations.pop(uid, None)  # a grant already written stays: inputs gone never take one back
            return
        if uid in self.others:
            # Known by its containers a while longer: the kubelet may still be stopping them (a force deletion).
            self.others[uid] = slim_pod(pod)
            self._departed.setdefault(uid, time.monotonic())
        async with self._lock:
            tracked = self.pods.pop(uid, None)
            self.waiting.discard(uid)
            for key in [k for k in self.withheld if k[0] == uid]:
                del self.withheld[key]
            removed = await asyncio.to_thread(remove_grants, self.root, uid)
        for container in removed:
            log.info("grant removed", extra={"node": self.node, "pod_uid": uid, "container": container})
            await self._tell(tracked or _Tracked(pod), GrantDecision(pod=_ref(pod), node_name=self.node, container=container, outcome="removed"))

    async def _inputs(self, pod: Obj, container: Obj) -> Inputs:
        namespace = str(pod["metadata"].get("namespace") or "")
        refs = {name: env_ref(container, name) for name in (LIMIT_ENV, DEVICES_ENV)}
        maps: dict[str, dict[str, str] | None] = {}
        for ref in refs.values():
            if ref is not None and ref.configmap is not None and ref.configmap not in maps:
                maps[ref.configmap] = await self._configmap(namespace, ref.configmap)
        missing = tuple(sorted(name for name, data in maps.items() if data is None))

        def value(ref: EnvRef | None) -> str | None:
            if ref is None:
                return None
            if ref.literal is not None:
                return ref.literal
            return (maps.get(ref.configmap or "") or {}).get(ref.key)

        return Inputs(value(refs[LIMIT_ENV]), value(refs[DEVICES_ENV]), await self._node_label(), missing, held_by_group(self.reservations.values()))

    async def _configmap(self, namespace: str, name: str) -> dict[str, str] | None:
        found = await self._read(self.core.read_namespaced_config_map(name, namespace, _preload_content=False, _request_timeout=_TIMEOUT))
        return None if found is None else {str(k): str(v) for k, v in (found.get("data") or {}).items()}

    async def _node_label(self) -> str | None:
        node = await self._read(self.core.read_node(self.node, _preload_content=False, _request_timeout=_TIMEOUT))
        return None if node is None else ((node.get("metadata") or {}).get("labels") or {}).get(GPU_MEMORY_NODE_LABEL)

    @staticmethod
    async def _read(request: Awaitable[Any]) -> Obj | None:
        """One object as plain JSON (no client models: they reject what a real server may leave out); None on 404."""
        response = await request
        try:
            body = await response.read()
        finally:
            response.release()
        if response.status == 404:
            return None
        if response.status >= 400:
            raise ApiException(status=response.status, reason=body[:200].decode("utf-8", "replace"))
        return json.loads(body)

    def _event(self, pod: Obj, decision: Decision, outcome: str, grant: Grant | None, reasons: list[Reason]) -> GrantDecision:
        return GrantDecision(
            pod=_ref(pod), node_name=self.node, container=decision.container, outcome=outcome,  # type: ignore[arg-type]
            source=grant.source.value if grant else None, limit_bytes=grant.devices[0].limit_bytes if grant else None,
            devices=[d.uuid for d in grant.devices] if grant else [], configmap_limit_bytes=decision.configmap_limit_bytes,
            annotation_limit_bytes=decision.annotation_limit_bytes, reasons=reasons,
        )

    async def _tell(self, tracked: _Tracked, event: GrantDecision) -> None:
        """Log and publish each distinct decision once per pod (watch events repeat the same facts)."""
        key = event.dedup_id()
        if event.outcome == "withheld":
            self.withheld[(event.pod.uid, event.container)] = "; ".join(f"{r.code}: {r.message}" for r in event.reasons) or "withheld"
        elif event.outcome in ("written", "kept"):
            self.withheld.pop((event.pod.uid, event.container), None)
        if key in tracked.published:
            return
        tracked.published.add(key)
        level = logging.INFO if event.outcome in ("written", "removed") and not event.reasons else logging.WARNING
        log.log(level, "grant %s", event.outcome, extra={
            "node": self.node, "pod": f"{event.pod.namespace}/{event.pod.name}", "container": event.container,
            "reasons": "; ".join(f"{r.code}: {r.message}" for r in event.reasons)})
        try:
            await self.publish(event)
        except Exception as error:  # noqa: BLE001 - the bus being away must never stop grants being written
            log.warning("could not publish a grant decision", extra={"node": self.node, "error": repr(error)})
        if event.outcome == "withheld" and self.on_withheld is not None:
            try:
                await self.on_withheld(event.pod, event.container, self.withheld[(event.pod.uid, event.container)],
                                       "grant-withheld-" + hashlib.sha256(key.encode()).hexdigest()[:16])
            except Exception as error:  # noqa: BLE001 - the API being away must never stop grants being written
                log.warning("could not post the GrantWithheld Event", extra={"node": self.node, "error": repr(error)})


def _read_quietly(root: Path, uid: str, container: str) -> Grant | None:
    try:
        return read_grant(root, uid, container)
    except ConfigError:
        return None


def _ref(pod: Obj) -> PodRef:
    meta = pod.get("metadata") or {}
    return PodRef(namespace=str(meta.get("namespace") or ""), name=str(meta.get("name") or ""), uid=str(meta.get("uid") or ""))
