"""What the verifier tells Kubernetes: an Event on the pod for each new verdict, and optionally an annotation."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from collections.abc import Awaitable
from pathlib import Path

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from kai_isolator.shared import kube_events
from kai_isolator.shared.events import HealthVerdict
from kai_isolator.shared.operator_view import ISOLATED_CONDITION, NODE_VIEW_ANNOTATION, NodeAgentView, condition_message

log = logging.getLogger(__name__)

COMPONENT = "kai-isolator-verifier"
REASONS = {"verified": ("IsolationVerified", "Normal"), "degraded": ("IsolationDegraded", "Warning"), "missing": ("IsolationMissing", "Warning"),
           "breached": ("IsolationBreached", "Warning")}
MISSING_ANNOTATION = "kai-resource-isolator.io/isolation-missing"


class PodNotifier:
    """Posts Events (and the optional annotation) with kubernetes-asyncio; failures are logged, never raised."""

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)

    @classmethod
    async def connect(cls, kubeconfig: Path | None) -> PodNotifier:
        configuration = client.Configuration()
        if kubeconfig:
            await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
        return cls(client.ApiClient(configuration))

    async def close(self) -> None:
        await self._api.close()

    async def post_event(self, verdict: HealthVerdict) -> bool:
        reason, kind = REASONS[verdict.verdict]
        message = f"container {verdict.container}: {verdict.verdict}"
        if verdict.reasons:
            message += " (" + "; ".join(f"{r.code}: {r.message}" for r in verdict.reasons) + ")"
        # Named after the observation, so a retried post is a harmless 409, not a second Event.
        return await kube_events.post_event(self._api, verdict.pod, reason=reason, kind=kind, message=message,
                                            key=verdict.observation, component=COMPONENT, container=verdict.container)

    async def evict(self, verdict: HealthVerdict) -> bool:
        """Evict through the Eviction API, so PodDisruptionBudgets still protect the workload."""
        return await kube_events.evict(self._api, verdict.pod)

    async def annotate_missing(self, verdict: HealthVerdict) -> bool:
        codes = ",".join(r.code for r in verdict.reasons) or "missing"
        patch = {"metadata": {"annotations": {MISSING_ANNOTATION: codes}}}
        return await self._call("annotate pod", verdict, self._core.patch_namespaced_pod(verdict.pod.name, verdict.pod.namespace, patch, _request_timeout=(5, 10)))

    async def set_condition(self, verdict: HealthVerdict) -> bool:
        """Write the pod's `kai-resource-isolator.io/Isolated` condition through the status subresource.

        Read-modify-write with the resourceVersion, retried on a conflict, so the kubelet's own conditions
        are kept. A condition that already says this is left alone (a retried verdict writes nothing), and
        lastTransitionTime moves only when the status flips; lastProbeTime is when the verdict was observed.
        """
        ns, name = verdict.pod.namespace, verdict.pod.name
        status = "True" if verdict.verdict == "verified" else "False"
        reason = verdict.reasons[0].code if verdict.reasons else verdict.verdict
        message = condition_message(verdict.verdict, verdict.container, [(r.code, r.message) for r in verdict.reasons])
        for _ in range(5):
            try:
                pod = await self._core.read_namespaced_pod_status(name, ns, _request_timeout=(5, 10))
            except ApiException as error:
                log.warning("could not read the pod for its condition", extra={"pod": f"{ns}/{name}", "status": error.status})
                return False
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                log.warning("Kubernetes API unreachable; could not set the condition", extra={"pod": f"{ns}/{name}", "error": repr(error)})
                return False
            if verdict.pod.uid and pod.metadata.uid != verdict.pod.uid:
                return False  # a new pod under the old name: this verdict is not about it
            conditions = list(pod.status.conditions or []) if pod.status else []
            old = next((c for c in conditions if c.type == ISOLATED_CONDITION), None)
            if old is not None and (old.status, old.reason, old.message) == (status, reason, message):
                return True
            condition = client.V1PodCondition(
                type=ISOLATED_CONDITION, status=status, reason=reason, message=message, last_probe_time=verdict.observed_at,
                last_transition_time=old.last_transition_time if old is not None and old.status == status else datetime.now(timezone.utc))
            pod.status.conditions = [c for c in conditions if c.type != ISOLATED_CONDITION] + [condition]
            try:
                await self._core.replace_namespaced_pod_status(name, ns, pod, _request_timeout=(5, 10))
                return True
            except ApiException as error:
                if error.status == 409:
                    continue  # the kubelet wrote status meanwhile: read again
                log.warning("could not set the pod condition", extra={"pod": f"{ns}/{name}", "status": error.status, "reason": error.reason})
                return False
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                log.warning("Kubernetes API unreachable; could not set the condition", extra={"pod": f"{ns}/{name}", "error": repr(error)})
                return False
        log.warning("pod condition not written: conflicts kept coming", extra={"pod": f"{ns}/{name}"})
        return False

    async def annotate_node(self, view: NodeAgentView) -> bool:
        """Write the node agent's view of its node onto the Node (a merge patch of one annotation)."""
        patch = {"metadata": {"annotations": {NODE_VIEW_ANNOTATION: view.model_dump_json()}}}
        try:
            await self._core.patch_node(view.node, patch, _request_timeout=(5, 10))
        except ApiException as error:
            log.warning("could not annotate the node", extra={"node": view.node, "status": error.status, "reason": error.reason})
            return False
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            log.warning("Kubernetes API unreachable; could not annotate the node", extra={"node": view.node, "error": repr(error)})
            return False
        return True

    async def _call(self, what: str, verdict: HealthVerdict, request: Awaitable[object], already_done: int | None = None) -> bool:
        """Run one API request; a failure is logged (the verdict on the bus stands), never raised."""
        pod = f"{verdict.pod.namespace}/{verdict.pod.name}"
        try:
            await request
        except ApiException as error:
            if error.status == already_done:
                return True
            log.warning(f"could not {what}", extra={"pod": pod, "status": error.status, "reason": error.reason})
            return False
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            log.warning(f"Kubernetes API unreachable; could not {what}", extra={"pod": pod, "error": repr(error)})
            return False
        return True
