"""What the verifier tells Kubernetes: an Event on the pod for each new verdict, and optionally an annotation."""

from __future__ import annotations

import asyncio
import logging
import socket
from datetime import datetime, timezone
from collections.abc import Awaitable
from pathlib import Path

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from kai_isolator.shared.events import HealthVerdict

log = logging.getLogger(__name__)

COMPONENT = "kai-isolator-verifier"
REASONS = {"verified": ("IsolationVerified", "Normal"), "degraded": ("IsolationDegraded", "Warning"), "missing": ("IsolationMissing", "Warning")}
MISSING_ANNOTATION = "kai-resource-isolator.io/isolation-missing"


class PodNotifier:
    """Posts Events (and the optional annotation) with kubernetes-asyncio; failures are logged, never raised."""

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)
        self._instance = socket.gethostname()

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
        now = datetime.now(timezone.utc)
        message = f"container {verdict.container}: {verdict.verdict}"
        if verdict.reasons:
            message += " (" + "; ".join(f"{r.code}: {r.message}" for r in verdict.reasons) + ")"
        body = client.CoreV1Event(
            # Named after the observation, so a retried post is a harmless 409, not a second Event.
            metadata=client.V1ObjectMeta(name=f"{verdict.pod.name}.{verdict.observation}", namespace=verdict.pod.namespace),
            involved_object=client.V1ObjectReference(
                api_version="v1", kind="Pod", name=verdict.pod.name, namespace=verdict.pod.namespace, uid=verdict.pod.uid,
                field_path=f"spec.containers{{{verdict.container}}}" if verdict.container else None,
            ),
            reason=reason, type=kind, message=message[:1024], count=1, first_timestamp=now, last_timestamp=now,
            source=client.V1EventSource(component=COMPONENT), reporting_component=COMPONENT, reporting_instance=self._instance,
        )
        request = self._core.create_namespaced_event(verdict.pod.namespace, body, _request_timeout=(5, 10))
        return await self._call("post the Kubernetes Event", verdict, request, already_done=409)

    async def evict(self, verdict: HealthVerdict) -> bool:
        """Evict through the Eviction API, so PodDisruptionBudgets still protect the workload."""
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=verdict.pod.name, namespace=verdict.pod.namespace))
        return await self._call("evict pod", verdict, self._core.create_namespaced_pod_eviction(verdict.pod.name, verdict.pod.namespace, body, _request_timeout=(5, 10)))

    async def annotate_missing(self, verdict: HealthVerdict) -> bool:
        codes = ",".join(r.code for r in verdict.reasons) or "missing"
        patch = {"metadata": {"annotations": {MISSING_ANNOTATION: codes}}}
        return await self._call("annotate pod", verdict, self._core.patch_namespaced_pod(verdict.pod.name, verdict.pod.namespace, patch, _request_timeout=(5, 10)))

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
