"""Pod and AdmissionReview builders for the webhook's unit tests."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.webhook import Answer, Webhook

PodFactory = Callable[..., dict[str, Any]]


def make_pod(annotations: dict[str, str] | None = None, containers: list[str] | None = None,
             inits: list[str] | None = None, volumes: list[dict[str, Any]] | None = None,
             seccomp: str | None = "RuntimeDefault") -> dict[str, Any]:
    """Like upstream's makePod: namespace test-ns, pod test-pod, no volumes unless given; a pod-level
    seccomp profile unless `seccomp` is None (the policy denies GPU-sharing pods without one)."""
    spec: dict[str, Any] = {"containers": [{"name": n, "image": "busybox"} for n in (containers if containers is not None else ["main"])]}
    if seccomp is not None:
        spec["securityContext"] = {"seccompProfile": {"type": seccomp}}
    if inits:
        spec["initContainers"] = [{"name": n, "image": "busybox"} for n in inits]
    if volumes is not None:
        spec["volumes"] = volumes
    metadata: dict[str, Any] = {"name": "test-pod", "namespace": "test-ns"}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def review_of(pod: Any, *, uid: str = "uid-1", operation: str = "CREATE", kind: str = "Pod", old: Any = None) -> bytes:
    """A review as the API server sends it; an UPDATE carries the pod before it (`old`, else `pod` itself)."""
    request = {"uid": uid, "kind": {"group": "", "version": "v1", "kind": kind}, "operation": operation, "namespace": "test-ns", "object": pod}
    if operation == "UPDATE":
        request["oldObject"] = pod if old is None else old
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})


def response_of(answer: Answer) -> dict[str, Any]:
    assert answer.status == 200, answer.body
    return orjson.loads(answer.body)["response"]


def patch_of(answer: Answer) -> list[dict[str, Any]]:
    response = response_of(answer)
    if "patch" not in response:
        assert "patchType" not in response
        return []
    assert response["patchType"] == "JSONPatch"
    return orjson.loads(base64.b64decode(response["patch"]))


def ops_for(ops: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    return [op for op in ops if op["path"] == path]


@pytest.fixture
def kit() -> SimpleNamespace:
    """The builders above, for tests (helpers in a conftest are not importable by name)."""
    return SimpleNamespace(make_pod=make_pod, review_of=review_of, response_of=response_of, patch_of=patch_of, ops_for=ops_for)


@pytest.fixture
def webhook() -> Webhook:
    return Webhook(InjectionConfig(), "warn")


@pytest.fixture
def mutate(webhook: Webhook) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """Pod in, JSON patch ops out (through the whole review path)."""
    return lambda pod: patch_of(webhook.handle(review_of(pod)))
