"""Our webhook and the real KAI-Scheduler admission on one real API server, registered under their real names: ours
(`kai-resource-isolator-mutating`) sorts first, KAI's (`mutating-kai-admission`) second, and the API server calls ours
once more because KAI changed the pod. Under `--policy enforce` and `warn` alike, the seed's pod gets in with no
finding, both injections, and nothing added twice; a tenant's own envFrom is still judged."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.settings import PolicyMode
from kai_isolator.services.admission.webhook import Webhook
from kai_isolator.services.devcluster.cluster import GPU_SHARING_CONDITION
from kai_isolator.services.devcluster.kai import ADMISSION_NAME, CONFIGMAP_ANNOTATION
from kai_isolator.services.devcluster.plane import ApiCallError, ControlPlane
from kai_isolator.shared.ports import free_port
from kai.real_kai import TENANT, RealKaiAdmission, dry_run_create, until_in_force

Obj = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]
OURS = "kai-resource-isolator-mutating"  # the chart's and kustomize's name for our configuration
REGISTRATION = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
# The seed's pod, with the confining seccomp profile the policy asks for.
SEED_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: gpu-memory-demo
  annotations:
    gpu-memory: "4096"
spec:
  schedulerName: kai-scheduler
  securityContext:
    seccompProfile: {type: RuntimeDefault}
  containers:
    - name: main
      image: busybox
      command: ["sleep", "infinity"]
"""


class OurWebhook:
    """`Webhook.handle` behind HTTPS on loopback, keeping every pod it was shown."""

    def __init__(self, mode: PolicyMode) -> None:
        self.webhook = Webhook(InjectionConfig(), mode)
        self.seen: list[Obj] = []
        self.ca = trustme.CA()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1").configure_cert(context)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                outer.seen.append(json.loads(raw)["request"]["object"])
                answer = outer.webhook.handle(raw)
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def configuration(self) -> Obj:
        hook = {"name": "kai-resource-isolator.kai-isolator.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "failurePolicy": "Fail", "reinvocationPolicy": "IfNeeded", "matchConditions": [GPU_SHARING_CONDITION],
                "clientConfig": {"url": f"https://127.0.0.1:{self.server.server_address[1]}/mutate",
                                 "caBundle": base64.b64encode(self.ca.cert_pem.bytes()).decode()},
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced"}]}
        return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration", "metadata": {"name": OURS},
                "webhooks": [hook]}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def ours_registered(plane: ControlPlane, mode: PolicyMode) -> Iterator[OurWebhook]:
    ours = OurWebhook(mode)
    with contextlib.suppress(ApiCallError):
        plane.request("DELETE", f"{REGISTRATION}/{OURS}")
    plane.request("POST", REGISTRATION, ours.configuration())
    try:
        until_in_force(plane, TENANT, lambda p: any(v["name"] == "kai-resource-isolator-vgpu" for v in p["spec"].get("volumes") or []),
                       "our webhook")
        ours.seen.clear()
        yield ours
    finally:
        with contextlib.suppress(ApiCallError):
            plane.request("DELETE", f"{REGISTRATION}/{OURS}")
        ours.stop()


def test_the_configurations_sort_ours_first() -> None:
    """What the order rests on: the API server calls configurations sorted by name; ours as deploy/ ships it, KAI's as
    its operator names it."""
    shipped = yaml.safe_load_all((REPO / "deploy" / "kustomize" / "base" / "webhook-configuration.yaml").read_text())
    ours = next(d["metadata"]["name"] for d in shipped if d and d["kind"] == "MutatingWebhookConfiguration")
    assert ours == OURS and sorted([ADMISSION_NAME, ours]) == [ours, ADMISSION_NAME]


@pytest.mark.parametrize("mode", ["enforce", "warn"])
def test_the_seed_pod_passes_ours_then_kais_then_ours_again(kai_plane: ControlPlane, seed_kai: RealKaiAdmission, mode: PolicyMode) -> None:
    with ours_registered(kai_plane, mode) as ours:
        created = kai_plane.kubectl("create", "--dry-run=server", "-o", "json", "-n", TENANT, "-f", "-", input_text=SEED_POD, check=False)
        seen = list(ours.seen)
    assert created.returncode == 0, created.stderr
    assert "Warning" not in created.stderr, created.stderr  # warn mode would print each finding here
    pod = json.loads(created.stdout)
    # Ours saw the pod first, untouched by KAI; then again with KAI's ConfigMap env and envFrom in it.
    assert len(seen) == 2 and CONFIGMAP_ANNOTATION not in (seen[0]["metadata"].get("annotations") or {})
    prefix = pod["metadata"]["annotations"][CONFIGMAP_ANNOTATION]
    assert seen[1]["spec"]["containers"][0]["envFrom"] == [{"configMapRef": {"name": f"{prefix}-0-evar", "optional": False}}]
    main = pod["spec"]["containers"][0]
    names = [e["name"] for e in main["env"]]
    assert {"POD_UID", "CONTAINER_NAME", "CUDA_DEVICE_MEMORY_LIMIT", "GPU_PORTION", "NVIDIA_VISIBLE_DEVICES"} <= set(names)
    assert len(names) == len(set(names))
    volumes = [v["name"] for v in pod["spec"]["volumes"]]
    assert volumes.count("kai-resource-isolator-vgpu") == 1 and f"{prefix}-0-vol" in volumes
    assert {"/etc/ld.so.preload", "/etc/kai-isolator"} <= {m["mountPath"] for m in main["volumeMounts"]}
    assert pod["spec"]["runtimeClassName"] == "nvidia"


def test_a_tenants_own_envfrom_beside_kais_is_still_denied_under_enforce(kai_plane: ControlPlane, seed_kai: RealKaiAdmission) -> None:
    tenant = yaml.safe_load(SEED_POD)
    tenant["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "my-settings"}}]
    with ours_registered(kai_plane, "enforce"):
        with pytest.raises(ApiCallError) as denied:
            dry_run_create(kai_plane, TENANT, tenant)
    message = str(denied.value)
    assert denied.value.code == 403 and "takes env from envFrom sources the webhook cannot check (configMapRef my-settings)" in message
