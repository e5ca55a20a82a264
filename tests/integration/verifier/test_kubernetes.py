"""What the verifier tells Kubernetes, against the real kube-apiserver (`dev_cluster`) through kubernetes-asyncio:
Events, the annotation, eviction, and an API server that is away."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.verifier.kube import MISSING_ANNOTATION, PodNotifier
from kai_isolator.shared.events import HealthVerdict, PodRef, Reason


@pytest.fixture
async def notifier(dev_cluster: DevCluster) -> AsyncIterator[PodNotifier]:
    connected = await PodNotifier.connect(dev_cluster.kubeconfig)
    yield connected
    await connected.close()


@contextlib.asynccontextmanager
async def apiserver_away(cluster: DevCluster) -> AsyncIterator[None]:
    """kube-apiserver killed for the body (etcd keeps the store), started again after it on the same port.

    Killed, not asked to stop: an outage gives no notice, and a SIGTERM waits out open watches (the simulated
    kubelets' and scheduler's) for the plane's full 10 s. The plane is shared by the whole session, so it comes
    back even when the body fails.
    """
    plane = cluster.plane
    assert plane is not None and plane._apiserver is not None
    os.killpg(plane._apiserver.pid, signal.SIGKILL)  # its own session: the group is the process we started
    await asyncio.to_thread(plane._apiserver.wait, 10)
    try:
        yield
    finally:
        await asyncio.to_thread(plane._start_apiserver, "kube-apiserver after an outage")


async def missing_verdict(cluster: DevCluster, name: str) -> HealthVerdict:
    # No GPU annotation and no node: neither KAI's admission nor its scheduler touch it, it stays Pending.
    pod = await cluster.create("pods", {"metadata": {"name": name}, "spec": {"containers": [{"name": "main", "image": "x"}]}}, "default")
    ref = PodRef(namespace="default", name=name, uid=pod["metadata"]["uid"])
    return HealthVerdict(pod=ref, node_name="gpu-1", container="main", verdict="missing",
                         reasons=[Reason(code="not-injected", message="no injection")], observation="abc123")


async def isolation_events(cluster: DevCluster, name: str) -> list[dict[str, Any]]:
    events = await cluster.list("events", "default")
    return [e for e in events if e["involvedObject"]["name"] == name and e["reason"].startswith("Isolation")]


async def test_a_verdict_becomes_one_event_even_when_posted_twice(dev_cluster: DevCluster, notifier: PodNotifier) -> None:
    verdict = await missing_verdict(dev_cluster, "p1")
    assert await notifier.post_event(verdict) and await notifier.post_event(verdict)
    [event] = await isolation_events(dev_cluster, "p1")
    assert event["type"] == "Warning" and event["reason"] == "IsolationMissing"
    assert event["involvedObject"]["uid"] == verdict.pod.uid and "not-injected: no injection" in event["message"]
    assert event["source"]["component"] == "kai-isolator-verifier"


async def test_annotate_marks_the_pod_with_the_reason_codes(dev_cluster: DevCluster, notifier: PodNotifier) -> None:
    verdict = await missing_verdict(dev_cluster, "p2")
    assert await notifier.annotate_missing(verdict)
    pod = await dev_cluster.get("pods", "default", "p2")
    assert pod["metadata"]["annotations"][MISSING_ANNOTATION] == "not-injected"


async def test_evict_removes_the_pod_through_the_eviction_api(dev_cluster: DevCluster, notifier: PodNotifier) -> None:
    verdict = await missing_verdict(dev_cluster, "p3")
    assert await notifier.evict(verdict)
    await dev_cluster.wait_gone("pods", "default", "p3")  # an eviction is a graceful deletion for a running pod
    assert await notifier.evict(verdict)  # evicting it again finds nothing to evict: done, not an error


async def test_an_unreachable_api_is_logged_not_raised(dev_cluster: DevCluster, notifier: PodNotifier) -> None:
    verdict = await missing_verdict(dev_cluster, "p4")
    async with apiserver_away(dev_cluster):
        assert not await notifier.post_event(verdict)
        assert not await notifier.evict(verdict)
        assert not await notifier.annotate_missing(verdict)
    # Nothing was written while it was away.
    assert await isolation_events(dev_cluster, "p4") == []
    assert MISSING_ANNOTATION not in ((await dev_cluster.get("pods", "default", "p4"))["metadata"].get("annotations") or {})
