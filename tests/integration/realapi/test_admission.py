"""The real API server calls our webhook through deploy/'s configuration: over TLS, with the caBundle `certs` set."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from control_plane.cluster import ApiCallError, ControlPlane
from control_plane.fixtures import NAMESPACE, make_namespace
from control_plane.webhook import SECRET, RunningWebhook, run_certs
from kai_isolator.shared.embedded_nats import EmbeddedNats

SEED_POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: gpu-sharing-demo
  annotations:
    gpu-memory: "4096"
spec:
  schedulerName: kai-scheduler
  containers:
    - name: main
      image: nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04
      command: ["sleep", "infinity"]
"""
LIBRARY_VOLUME = "kai-resource-isolator-vgpu"


@pytest.fixture(scope="module")
def certs_output(control_plane: ControlPlane, deployed: list[dict[str, Any]]) -> str:
    """The certs Job's one-shot, run once under the Job's ServiceAccount and RBAC."""
    done = run_certs(control_plane, control_plane.service_account_kubeconfig(NAMESPACE, "kai-resource-isolator-certs"))
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


@pytest.fixture
def webhook(control_plane: ControlPlane, certs_output: str, nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[RunningWebhook]:
    running = RunningWebhook(control_plane, tmp_path, nats_server.url).start()
    yield running
    running.stop()


def _create(plane: ControlPlane, namespace: str, manifest: str) -> dict[str, Any]:
    plane.kubectl("create", "-n", namespace, "-f", "-", input_text=manifest)
    name = yaml.safe_load(manifest)["metadata"]["name"]
    return json.loads(plane.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)


def _pod(name: str, annotations: dict[str, str]) -> str:
    pod = yaml.safe_load(SEED_POD)
    pod["metadata"] = {"name": name, "annotations": annotations}
    return yaml.safe_dump(pod)


def _injected(pod: dict[str, Any]) -> bool:
    return any(v["name"] == LIBRARY_VOLUME for v in pod["spec"].get("volumes", []))


def test_certs_sets_the_ca_bundle_the_api_server_trusts(control_plane: ControlPlane, certs_output: str) -> None:
    assert f"Secret {NAMESPACE}/{SECRET} created" in certs_output
    assert "caBundle set on 1 webhook(s)" in certs_output
    secret = control_plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}")
    config = control_plane.request("GET", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/kai-resource-isolator-mutating")
    assert config["webhooks"][0]["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    again = run_certs(control_plane, control_plane.service_account_kubeconfig(NAMESPACE, "kai-resource-isolator-certs"))
    assert again.returncode == 0, again.stderr
    assert "kept" in again.stdout and "already trusts this CA" in again.stdout


def test_the_seed_pod_created_with_kubectl_is_mutated_by_the_real_api_server(control_plane: ControlPlane, webhook: RunningWebhook) -> None:
    namespace = make_namespace(control_plane, "seed")
    pod = _create(control_plane, namespace, SEED_POD)
    assert pod["spec"]["schedulerName"] == "kai-scheduler"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == LIBRARY_VOLUME)
    assert volume["hostPath"] == {"path": "/usr/local/vgpu", "type": "Directory"}
    main = pod["spec"]["containers"][0]
    preload = next(m for m in main["volumeMounts"] if m["mountPath"] == "/etc/ld.so.preload")
    assert preload == {"name": LIBRARY_VOLUME, "mountPath": "/etc/ld.so.preload", "subPath": "ld.so.preload", "readOnly": True}
    env = {e["name"]: e for e in main["env"]}
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env["CONTAINER_NAME"]["value"] == "main"
    assert "admission" in webhook.output()  # the reviews really reached the process deploy/ describes


def test_a_pod_annotation_opts_out(control_plane: ControlPlane, webhook: RunningWebhook) -> None:
    namespace = make_namespace(control_plane, "opt-out")
    pod = _create(control_plane, namespace, _pod("opted-out", {"gpu-memory": "4096", "kai-resource-isolator.io/inject": "false"}))
    assert not _injected(pod)


def test_with_the_webhook_down_failure_policy_fail_refuses_only_gpu_sharing_pods(control_plane: ControlPlane, webhook: RunningWebhook) -> None:
    webhook.stop()
    namespace = make_namespace(control_plane, "hook-down")
    refused = control_plane.kubectl("create", "-n", namespace, "-f", "-", input_text=SEED_POD, check=False)
    assert refused.returncode != 0
    assert 'failed calling webhook "vgpu.lib.kai-resource-isolator.io"' in refused.stderr, refused.stderr
    # matchConditions keep every other pod away from the webhook: it is not called, so its outage does not matter.
    plain = _create(control_plane, namespace, _pod("no-gpu", {"team": "a"}))
    assert not _injected(plain)
    # The namespaceSelector: an admin's `ignore` label, and kube-system, are never sent to it.
    ignored = make_namespace(control_plane, "ignored", labels={"kai-resource-isolator.io/webhook": "ignore"})
    assert not _injected(_create(control_plane, ignored, _pod("ignored", {"gpu-memory": "4096"})))
    try:
        control_plane.request("POST", "/api/v1/namespaces/kube-system/serviceaccounts",
                              {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    except ApiCallError as error:
        assert error.code == 409
    assert not _injected(_create(control_plane, "kube-system", _pod("system-gpu-pod", {"gpu-fraction": "0.5"})))


def test_the_api_server_checks_the_webhook_certificate(control_plane: ControlPlane, webhook: RunningWebhook) -> None:
    """A caBundle that does not sign the serving certificate: the API server refuses the TLS handshake, so it fails closed."""
    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/kai-resource-isolator-mutating"
    good = control_plane.request("GET", path)["webhooks"][0]["clientConfig"]["caBundle"]
    stranger = base64.b64encode(trustme.CA().cert_pem.bytes()).decode()
    patch = [{"op": "replace", "path": "/webhooks/0/clientConfig/caBundle", "value": stranger}]
    control_plane.request("PATCH", path, patch, content_type="application/json-patch+json")
    try:
        namespace = make_namespace(control_plane, "bad-ca")
        refused = control_plane.kubectl("create", "-n", namespace, "-f", "-", input_text=SEED_POD, check=False)
        assert refused.returncode != 0 and "x509" in refused.stderr, refused.stderr
    finally:
        restore = [{"op": "replace", "path": "/webhooks/0/clientConfig/caBundle", "value": good}]
        control_plane.request("PATCH", path, restore, content_type="application/json-patch+json")
