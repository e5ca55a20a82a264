"""Mutating admission in the sandbox: real AdmissionReview v1 over HTTPS, honouring the configuration's knobs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import trustme
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.sandbox.status import ApiError

from .conftest import RecordingWebhook, pod_body

GPU_CONDITION = [{"name": "gpu", "expression": "has(object.metadata.annotations) && 'gpu-memory' in object.metadata.annotations"}]


async def test_webhook_mutates_created_pod(sandbox: SandboxApi, core: CoreV1Api, webhook: RecordingWebhook) -> None:
    await sandbox.register_webhook("test", webhook.url, webhook.ca_pem)
    created = await core.create_namespaced_pod("default", pod_body("p", {"gpu-memory": "4096"}))
    assert created.metadata.labels == {"mutated-by": "test-webhook"}
    assert sandbox.get("pods", "default", "p")["metadata"]["labels"] == {"mutated-by": "test-webhook"}
    review = webhook.reviews[0]
    assert review["apiVersion"] == "admission.k8s.io/v1" and review["request"]["operation"] == "CREATE"
    assert review["request"]["namespace"] == "default" and review["request"]["object"]["metadata"]["name"] == "p"
    assert "uid" not in review["request"]["object"]["metadata"]  # the apiserver assigns it after admission
    assert webhook.paths[0] == "/mutate?timeout=10s"
    # KAI's own admission ran first: the limit env var already points at the per-pod ConfigMap.
    env = review["request"]["object"]["spec"]["containers"][0]["env"]
    assert env[0]["name"] == "CUDA_DEVICE_MEMORY_LIMIT" and "configMapKeyRef" in env[0]["valueFrom"]


async def test_denial_carries_the_webhook_message(sandbox: SandboxApi, core: CoreV1Api, webhook: RecordingWebhook) -> None:
    async def deny(_: dict[str, Any]) -> dict[str, Any]:
        return {"allowed": False, "status": {"code": 403, "message": "LD_PRELOAD override is not allowed"}}

    webhook.respond = deny
    await sandbox.register_webhook("test", webhook.url, webhook.ca_pem)
    with pytest.raises(ApiException) as caught:
        await core.create_namespaced_pod("default", pod_body("p"))
    assert caught.value.status == 403
    assert 'admission webhook \\"test.sandbox.kai-isolator.io\\" denied the request: LD_PRELOAD override is not allowed' in caught.value.body
    assert sandbox.list("pods", "default")[0] == []


async def test_selectors_and_match_conditions_choose_the_pods(sandbox: SandboxApi, webhook: RecordingWebhook) -> None:
    await sandbox.create("namespaces", {"metadata": {"name": "quiet", "labels": {"kai-resource-isolator.io/webhook": "ignore"}}})
    opt_out = {"matchExpressions": [{"key": "kai-resource-isolator.io/webhook", "operator": "NotIn", "values": ["ignore"]}]}
    skip_label = {"matchExpressions": [{"key": "skip", "operator": "DoesNotExist"}]}
    await sandbox.register_webhook("test", webhook.url, webhook.ca_pem, namespace_selector=opt_out, object_selector=skip_label, match_conditions=GPU_CONDITION)
    gpu = {"gpu-memory": "1024"}
    await sandbox.create("pods", pod_body("plain"), "default")
    await sandbox.create("pods", pod_body("labelled", gpu, labels={"skip": "yes"}), "default")
    await sandbox.create("pods", pod_body("quiet-gpu", gpu), "quiet")
    mutated = await sandbox.create("pods", pod_body("gpu", gpu), "default")
    assert [r["request"]["object"]["metadata"]["name"] for r in webhook.reviews] == ["gpu"]
    assert mutated["metadata"]["labels"] == {"mutated-by": "test-webhook"}


async def test_unreachable_webhook_follows_failure_policy(sandbox: SandboxApi) -> None:
    ca = trustme.CA()
    await sandbox.register_webhook("closed", "https://127.0.0.1:9/mutate", ca.cert_pem.bytes(), failure_policy="Ignore", timeout_s=1)
    admitted = await sandbox.create("pods", pod_body("ignored"), "default")
    assert admitted["metadata"]["name"] == "ignored"
    sandbox.delete("mutatingwebhookconfigurations", None, "closed")
    await sandbox.register_webhook("closed", "https://127.0.0.1:9/mutate", ca.cert_pem.bytes(), failure_policy="Fail", timeout_s=1)
    with pytest.raises(ApiError) as caught:
        await sandbox.create("pods", pod_body("refused"), "default")
    assert caught.value.code == 500 and 'failed calling webhook "closed.sandbox.kai-isolator.io"' in caught.value.message


async def test_ca_bundle_is_honoured(sandbox: SandboxApi, webhook: RecordingWebhook) -> None:
    stranger = trustme.CA()
    await sandbox.register_webhook("test", webhook.url, stranger.cert_pem.bytes())
    with pytest.raises(ApiError) as caught:
        await sandbox.create("pods", pod_body("p"), "default")
    assert caught.value.code == 500 and "CERTIFICATE_VERIFY_FAILED" in caught.value.message
    assert webhook.reviews == []


async def test_slow_webhook_times_out(sandbox: SandboxApi, webhook: RecordingWebhook) -> None:
    release = asyncio.Event()

    async def stall(_: dict[str, Any]) -> dict[str, Any]:
        await release.wait()
        return {"allowed": True}

    webhook.respond = stall
    await sandbox.register_webhook("test", webhook.url, webhook.ca_pem, timeout_s=1)
    with pytest.raises(ApiError) as caught:
        await sandbox.create("pods", pod_body("p"), "default")
    release.set()
    assert "context deadline exceeded" in caught.value.message


@pytest.mark.parametrize(("change", "message"), [
    ({"clientConfig": {"url": "http://127.0.0.1:1/x"}}, "'https' scheme required"),
    ({"timeoutSeconds": 31}, "between 1 and 30"),
    ({"sideEffects": "Some"}, "sideEffects"),
    ({"matchConditions": [{"name": "x", "expression": "object.spec.containers.all(c, c.image != '')"}]}, "compilation failed"),
])
async def test_invalid_configurations_are_422(sandbox: SandboxApi, change: dict[str, Any], message: str) -> None:
    hook = {"name": "x.example.com", "clientConfig": {"url": "https://127.0.0.1:1/x"}, "sideEffects": "None", "admissionReviewVersions": ["v1"],
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}], **change}
    with pytest.raises(ApiError) as caught:
        await sandbox.create("mutatingwebhookconfigurations", {"metadata": {"name": "x"}, "webhooks": [hook]})
    assert caught.value.code == 422 and message in caught.value.message


ADMISSION_SERVER = Path(__file__).resolve().parents[3] / "services" / "admission" / "server.py"


@pytest.mark.skipif(not ADMISSION_SERVER.exists(), reason="the admission service (issue 2) has not landed")
async def test_real_admission_webhook_injects_library_end_to_end(sandbox: SandboxApi, core: CoreV1Api, tmp_path: Path) -> None:
    from kai_isolator.services.admission.certs import issue
    from kai_isolator.services.admission.server import AdmissionServer
    from kai_isolator.services.admission.settings import AdmissionSettings
    from kai_isolator.services.sandbox.dev import GPU_SHARING_CONDITION, NAMESPACE_OPT_OUT

    pair = issue(["localhost", "127.0.0.1"])
    _, cert, key = pair.write(tmp_path / "admission")
    server = AdmissionServer(AdmissionSettings(listen="127.0.0.1:0", tls_cert_file=cert, tls_private_key_file=key))
    await server.start()
    try:
        await sandbox.register_webhook("kai-resource-isolator", f"{server.url}/mutate", pair.ca_pem, namespace_selector=NAMESPACE_OPT_OUT, match_conditions=[GPU_SHARING_CONDITION])
        created = await core.create_namespaced_pod("default", pod_body("train", {"gpu-memory": "4096"}))
        plain = await core.create_namespaced_pod("default", pod_body("plain"))
    finally:
        await server.stop()
    volumes = {v.name: v for v in created.spec.volumes or []}
    assert volumes["kai-resource-isolator-vgpu"].host_path.path == "/usr/local/vgpu"
    preload = [m for m in created.spec.containers[0].volume_mounts if m.mount_path == "/etc/ld.so.preload"]
    assert preload and preload[0].read_only and preload[0].sub_path == "ld.so.preload"
    assert not plain.spec.volumes
