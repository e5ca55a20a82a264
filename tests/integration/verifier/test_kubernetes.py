"""What the verifier tells Kubernetes, against the sandbox API through kubernetes-asyncio: Events, annotation, eviction."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.sandbox.settings import SandboxSettings
from kai_isolator.services.verifier.kube import MISSING_ANNOTATION, PodNotifier
from kai_isolator.shared.errors import IsolatorError
from kai_isolator.shared.events import HealthVerdict, PodRef, Reason


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[SandboxApi]:
    async with SandboxApi(SandboxSettings(kubeconfig=tmp_path / "kubeconfig", gpu_nodes=())) as api:
        yield api


@pytest.fixture
async def notifier(sandbox: SandboxApi) -> AsyncIterator[PodNotifier]:
    assert sandbox.settings.kubeconfig is not None
    connected = await PodNotifier.connect(sandbox.settings.kubeconfig)
    yield connected
    await connected.close()


async def missing_verdict(sandbox: SandboxApi, name: str) -> HealthVerdict:
    pod = await sandbox.create("pods", {"metadata": {"name": name}, "spec": {"containers": [{"name": "main", "image": "x"}]}}, "default")
    ref = PodRef(namespace="default", name=name, uid=pod["metadata"]["uid"])
    return HealthVerdict(pod=ref, node_name="gpu-1", container="main", verdict="missing",
                         reasons=[Reason(code="not-injected", message="no injection")], observation="abc123")


def isolation_events(sandbox: SandboxApi, name: str) -> list[dict]:  # type: ignore[type-arg]
    events, _ = sandbox.list("events", "default")
    return [e for e in events if e["involvedObject"]["name"] == name and e["reason"].startswith("Isolation")]


async def test_a_verdict_becomes_one_event_even_when_posted_twice(sandbox: SandboxApi, notifier: PodNotifier) -> None:
    verdict = await missing_verdict(sandbox, "p1")
    assert await notifier.post_event(verdict) and await notifier.post_event(verdict)
    [event] = isolation_events(sandbox, "p1")
    assert event["type"] == "Warning" and event["reason"] == "IsolationMissing"
    assert event["involvedObject"]["uid"] == verdict.pod.uid and "not-injected: no injection" in event["message"]
    assert event["source"]["component"] == "kai-isolator-verifier"


async def test_annotate_marks_the_pod_with_the_reason_codes(sandbox: SandboxApi, notifier: PodNotifier) -> None:
    verdict = await missing_verdict(sandbox, "p2")
    assert await notifier.annotate_missing(verdict)
    assert sandbox.get("pods", "default", "p2")["metadata"]["annotations"][MISSING_ANNOTATION] == "not-injected"


async def test_evict_removes_the_pod_through_the_eviction_api(sandbox: SandboxApi, notifier: PodNotifier) -> None:
    verdict = await missing_verdict(sandbox, "p3")
    assert await notifier.evict(verdict)
    with pytest.raises(IsolatorError):
        sandbox.get("pods", "default", "p3")


async def test_an_unreachable_api_is_logged_not_raised(sandbox: SandboxApi, notifier: PodNotifier) -> None:
    verdict = await missing_verdict(sandbox, "p4")
    await sandbox.stop()
    assert not await notifier.post_event(verdict)
    assert not await notifier.evict(verdict)
