"""The real API server calls our webhook through deploy/'s configuration: over TLS, with the caBundle `certs` set."""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import ssl
import threading
from typing import Any

import trustme
import yaml

from kai_isolator.services.devcluster.kai import kai_admit
from kai_isolator.services.devcluster.plane import ApiCallError, ControlPlane
from kai_isolator.shared.ports import free_port
from support.pods import make_namespace
from support.webhook import NAMESPACE, SECRET, RunningWebhook, run_certs

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


def _naming_gpus(name: str, *, value: str | None = None, init: bool = False, env_from: bool = False) -> str:
    """A pod that shares no GPU and asks for no nvidia.com/gpu, one container of which (the init one) names GPUs itself."""
    container: dict[str, Any] = {"name": "main", "image": "busybox", "command": ["sleep", "infinity"]}
    if value is not None:
        container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": value}]
    if env_from:
        container["envFrom"] = [{"configMapRef": {"name": "gpus", "optional": True}}]
    spec: dict[str, Any] = {"containers": [{"name": "app", "image": "busybox"}], "initContainers": [container]} if init else {
        "containers": [container]}
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})


def test_a_pod_naming_gpus_for_the_runtime_reaches_the_webhook_and_no_other_does(control_plane: ControlPlane, webhook: RunningWebhook) -> None:
    """The matchConditions, as the real API server evaluates them (issue 45): at creation, a pod a container of which sets
    NVIDIA_VISIBLE_DEVICES to anything but void or none is sent to the webhook (under deploy/'s --policy warn: admitted,
    with the finding as a warning); with the webhook down such a pod is refused, and every other pod that shares no GPU
    is still created, its values from envFrom included (left to the node's enforcer)."""
    namespace = make_namespace(control_plane, "naming-gpus")
    warned = control_plane.kubectl("create", "-n", namespace, "-f", "-", input_text=_naming_gpus("all", value="all"))
    assert "kai-resource-isolator: container main sets NVIDIA_VISIBLE_DEVICES but asks for no nvidia.com/gpu" in warned.stderr, warned
    webhook.stop()
    for name, manifest in (("uuid", _naming_gpus("uuid", value="GPU-0000fa4e-1111-2222-3333-000000000000")),
                           ("init", _naming_gpus("init", value="all", init=True))):
        refused = control_plane.kubectl("create", "-n", namespace, "-f", "-", input_text=manifest, check=False)
        assert refused.returncode != 0 and 'failed calling webhook "vgpu.lib.kai-resource-isolator.io"' in refused.stderr, (name, refused.stderr)
    for manifest in (_naming_gpus("void", value="void"), _naming_gpus("none", value="none"), _naming_gpus("env-from", env_from=True),
                     _naming_gpus("nothing")):
        assert not _injected(_create(control_plane, namespace, manifest))


def test_with_the_webhook_down_failure_policy_fail_refuses_only_gpu_sharing_pods(control_plane: ControlPlane, webhook: RunningWebhook) -> None:
    webhook.stop()
    namespace = make_namespace(control_plane, "hook-down")
    refused = control_plane.kubectl("create", "-n", namespace, "-f", "-", input_text=SEED_POD, check=False)
    assert refused.returncode != 0
    assert 'failed calling webhook "vgpu.lib.kai-resource-isolator.io"' in refused.stderr, refused.stderr
    # matchConditions keep every other pod away from the webhook: it is not called, so its outage does not matter.
    plain = _create(control_plane, namespace, _pod("no-gpu", {"team": "a"}))
    assert not _injected(plain)
    bare = yaml.safe_load(_pod("no-annotations", {}))
    del bare["metadata"]["annotations"]  # the has() guard: without it the condition errors, and Fail refuses the pod
    assert not _injected(_create(control_plane, namespace, yaml.safe_dump(bare)))
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


class KaiAdmissionStandIn:
    """An HTTPS webhook that mutates as KAI-Scheduler's admission does (the limit env from its ConfigMap), after ours."""

    def __init__(self) -> None:
        self.ca = trustme.CA()
        self.calls = 0
        leaf = self.ca.issue_cert("127.0.0.1")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        leaf.configure_cert(context)
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.calls += 1
                pod = review["request"]["object"]
                shaped = kai_admit(json.loads(json.dumps({**pod, "metadata": {**pod["metadata"], "name": "p"}})))
                ops = [{"op": "replace", "path": "/metadata/annotations", "value": shaped["metadata"]["annotations"]},
                       {"op": "add", "path": "/spec/containers/0/env", "value": shaped["spec"]["containers"][0]["env"]}]
                answer = {"uid": review["request"]["uid"], "allowed": True, "patchType": "JSONPatch",
                          "patch": base64.b64encode(json.dumps(ops).encode()).decode()}
                body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": answer}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def configuration(self, label: str) -> dict[str, Any]:
        """Named after ours alphabetically, so the API server calls it second; only pods carrying `label`."""
        port = self.server.server_address[1]
        return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": "kai-scheduler-standin"},
                "webhooks": [{"name": "gpusharing.kai-scheduler.standin", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                              "failurePolicy": "Fail", "timeoutSeconds": 5,
                              "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate",
                                               "caBundle": base64.b64encode(self.ca.cert_pem.bytes()).decode()},
                              "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
                              "objectSelector": {"matchLabels": {label: "true"}}}]}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _decisions(webhook: RunningWebhook, plane: ControlPlane) -> float:
    """Our webhook's decision count, from its own /metrics (over its TLS port, trusting the Secret's CA)."""
    context = ssl.create_default_context(cadata=base64.b64decode(
        plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}")["data"]["ca.crt"]).decode())
    context.check_hostname = False  # the certificate names the Service; the chain is still checked
    connection = http.client.HTTPSConnection(webhook.address, webhook.port, context=context, timeout=5)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kai_isolator_admission_decisions_total{"))


def test_reinvoked_after_kai_mutates_the_pod_it_injects_once(control_plane: ControlPlane, webhook: RunningWebhook) -> None:
    """reinvocationPolicy IfNeeded, evaluated by a real API server: KAI's admission changes the pod after us, we are called
    again, and our second answer adds nothing (a second copy of our volume would make the pod invalid)."""
    label = "test.kai-isolator.io/kai-standin"
    kai = KaiAdmissionStandIn()
    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    control_plane.request("POST", path, kai.configuration(label))
    try:
        namespace = make_namespace(control_plane, "reinvoked")
        before = _decisions(webhook, control_plane)
        seed = yaml.safe_load(SEED_POD)
        seed["metadata"]["labels"] = {label: "true"}
        pod = _create(control_plane, namespace, yaml.safe_dump(seed))
    finally:
        control_plane.request("DELETE", f"{path}/kai-scheduler-standin")
        kai.stop()
    assert kai.calls == 1
    assert _decisions(webhook, control_plane) - before == 2  # ours, KAI's, ours again
    assert [v["name"] for v in pod["spec"]["volumes"]].count(LIBRARY_VOLUME) == 1
    env = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert "CUDA_DEVICE_MEMORY_LIMIT" in env and "POD_UID" in env and len(env) == len(set(env))


def test_a_pod_that_shares_no_gpu_is_never_sent_to_the_webhook(control_plane: ControlPlane, webhook: RunningWebhook) -> None:
    namespace = make_namespace(control_plane, "not-sent")
    before = _decisions(webhook, control_plane)
    _create(control_plane, namespace, _pod("web", {"team": "a"}))
    _create(control_plane, namespace, _pod("gpu", {"gpu-fraction": "0.5"}))
    assert _decisions(webhook, control_plane) - before == 1  # only the GPU-sharing pod was reviewed
