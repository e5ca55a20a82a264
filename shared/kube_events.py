"""Telling Kubernetes about a pod from any service: a Kubernetes Event on it, and an eviction through the
Eviction API. Failures are logged and answered False, never raised: what a service publishes on the bus stands."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable
from datetime import datetime, timezone
from typing import Literal

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from .events import PodRef

log = logging.getLogger(__name__)
_TIMEOUT = (5, 10)


async def post_event(api: client.ApiClient, pod: PodRef, *, reason: str, kind: Literal["Normal", "Warning"], message: str,
                     key: str, component: str, container: str = "") -> bool:
    """One Event on the pod, named `<pod>.<key>`: posting the same fact again is a harmless 409, not a second Event."""
    now = datetime.now(timezone.utc)
    body = client.CoreV1Event(
        metadata=client.V1ObjectMeta(name=f"{pod.name}.{key}", namespace=pod.namespace),
        involved_object=client.V1ObjectReference(
            api_version="v1", kind="Pod", name=pod.name, namespace=pod.namespace, uid=pod.uid or None,
            field_path=f"spec.containers{{{container}}}" if container else None,
        ),
        reason=reason, type=kind, message=message[:1024], count=1, first_timestamp=now, last_timestamp=now,
        source=client.V1EventSource(component=component, host=socket.gethostname()), reporting_component=component,
        reporting_instance=socket.gethostname(),
    )
    request = client.CoreV1Api(api).create_namespaced_event(pod.namespace, body, _request_timeout=_TIMEOUT)
    return await _call(f"post the {reason} Event", pod, request, already_done=409)


async def evict(api: client.ApiClient, pod: PodRef) -> bool:
    """Evict through the Eviction API, so PodDisruptionBudgets still protect the workload."""
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod.name, namespace=pod.namespace),
                             delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=pod.uid) if pod.uid else None))
    request = client.CoreV1Api(api).create_namespaced_pod_eviction(pod.name, pod.namespace, body, _request_timeout=_TIMEOUT)
    return await _call("evict the pod", pod, request, already_done=404)


async def _call(what: str, pod: PodRef, request: Awaitable[object], already_done: int | None = None) -> bool:
    where = f"{pod.namespace}/{pod.name}"
    try:
        await request
    except ApiException as error:
        if error.status == already_done:
            return True
        log.warning(f"could not {what}", extra={"pod": where, "status": error.status, "reason": error.reason})
        return False
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        log.warning(f"Kubernetes API unreachable; could not {what}", extra={"pod": where, "error": repr(error)})
        return False
    return True
