"""deploy/ against a real kube-apiserver: applied as users apply it, every object accepted, the webhook's CEL compiled."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kai_isolator.services.devcluster.plane import ApiCallError, ControlPlane
from support import REPO
from support.control_plane import BASE
from support.pods import make_namespace
from support.webhook import NAMESPACE

sys.path.insert(0, str(REPO / "tests" / "deploy"))  # importlib mode: the deploy checks' tool helpers
from deploy_tools import CHART, HELM_VARIANTS, helm_binary, run_tool, set_flags  # noqa: E402

WEBHOOK_CONFIG = "kai-resource-isolator-mutating"
MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


def _object_path(doc: dict[str, Any]) -> str:
    return f"{doc['kind']}/{doc['metadata'].get('namespace', '')}/{doc['metadata']['name']}"


def test_the_server_is_the_pinned_release_with_rbac_enforced(control_plane: ControlPlane) -> None:
    version = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == control_plane.binaries.kube_version
    assert version["clientVersion"]["gitVersion"] == control_plane.binaries.kube_version
    namespace = make_namespace(control_plane, "rbac-on")
    control_plane.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody"}})
    denied = control_plane.kubectl("get", "pods", kubeconfig=control_plane.service_account_kubeconfig(namespace, "nobody"), check=False)
    assert denied.returncode != 0
    assert f'User "system:serviceaccount:{namespace}:nobody" cannot list resource "pods"' in denied.stderr


def test_kustomize_base_applies_and_every_object_is_stored(control_plane: ControlPlane, deployed: list[dict[str, Any]]) -> None:
    stored = json.loads(control_plane.kubectl("get", "-k", str(BASE), "-o", "json").stdout)["items"]
    assert sorted(map(_object_path, stored)) == sorted(map(_object_path, deployed))
    # The server's defaulting does not fight what we ship: a server-side diff of the manifests finds nothing.
    diff = control_plane.kubectl("diff", "-k", str(BASE), check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr


def test_webhook_configuration_is_stored_as_shipped(control_plane: ControlPlane, deployed: list[dict[str, Any]]) -> None:
    shipped = next(d for d in deployed if d["kind"] == "MutatingWebhookConfiguration")["webhooks"][0]
    stored = control_plane.request("GET", f"{MWC_PATH}/{WEBHOOK_CONFIG}")["webhooks"][0]
    for field in ("failurePolicy", "matchPolicy", "reinvocationPolicy", "sideEffects", "timeoutSeconds", "namespaceSelector",
                  "matchConditions", "rules"):
        assert stored[field] == shipped[field], field
    assert stored["clientConfig"]["service"] == {**shipped["clientConfig"]["service"]}


@pytest.mark.parametrize("expression, complaint", [
    ("has(object.metadata.annotations) &&", "compilation failed"),
    ("'gpu-memory' in pod.metadata.annotations", "undeclared reference to 'pod'"),
    ("object.metadata.annotations", "must evaluate to bool"),
])
def test_the_server_compiles_the_match_conditions(control_plane: ControlPlane, deployed: list[dict[str, Any]], expression: str,
                                                  complaint: str) -> None:
    """The shipped expression was accepted above; a broken one is refused, so acceptance means the CEL compiled."""
    config = next(d for d in deployed if d["kind"] == "MutatingWebhookConfiguration")
    broken = json.loads(json.dumps(config))
    broken["metadata"] = {"name": "cel-check"}
    broken["webhooks"][0]["matchConditions"][0]["expression"] = expression
    with pytest.raises(ApiCallError) as refused:
        control_plane.request("POST", f"{MWC_PATH}?dryRun=All", broken)
    assert refused.value.code == 422
    assert complaint in refused.value.status["message"], refused.value.status["message"]


@pytest.mark.parametrize("variant", ["helm/default", "helm/minimal", "helm/nats-cluster"])
def test_helm_template_output_is_accepted(control_plane: ControlPlane, deployed: list[dict[str, Any]], tmp_path: Path, variant: str) -> None:
    """`helm template | kubectl apply` as a user runs it, server-side dry run (a second live copy would
    register a second fail-closed webhook for every GPU pod in the cluster)."""
    release = "kai-helm"
    namespace = make_namespace(control_plane, release)
    env = {**os.environ, **{f"HELM_{k}_HOME": str(tmp_path / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
    # --skip-tests: `helm test`'s pod is created by `helm test` alone (in tests.namespace), never applied with the release.
    rendered = run_tool([helm_binary(), "template", release, str(CHART), "--namespace", namespace, "--skip-tests",
                         *set_flags(HELM_VARIANTS[variant])], env=env)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert docs
    applied = control_plane.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input_text=rendered).stdout.splitlines()
    assert len(applied) == len(docs), applied
    assert all("(server dry run)" in line for line in applied), applied


@pytest.mark.parametrize("overlay", ["dev", "nats-cluster"])
def test_an_overlay_applies_over_the_base(control_plane: ControlPlane, deployed: list[dict[str, Any]], overlay: str) -> None:
    """Server-side dry run over the applied base. The certs Job is checked under another name: its template is
    immutable, and here no TTL controller has removed the finished base Job (ttlSecondsAfterFinished), as a cluster's would."""
    dev = REPO / "deploy" / "kustomize" / "overlays" / overlay
    rendered = [d for d in yaml.safe_load_all(control_plane.kubectl("kustomize", str(dev)).stdout) if d]
    for doc in rendered:
        if doc["kind"] == "Job":
            doc["metadata"]["name"] += "-dev-check"
    applied = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input_text=yaml.safe_dump_all(rendered)).stdout.splitlines()
    assert len(applied) == len(rendered) and all("(server dry run)" in line for line in applied), applied
    assert NAMESPACE in {d["metadata"].get("namespace") for d in rendered}


def test_what_a_new_user_types_works(control_plane: ControlPlane) -> None:
    """The sandbox failed these (no OpenAPI for kubectl's validation, no protobuf); the real server is the reference."""
    control_plane.kubectl("create", "namespace", "first-steps")
    control_plane.request("POST", "/api/v1/namespaces/first-steps/serviceaccounts",
                          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    control_plane.kubectl("create", "configmap", "settings", "-n", "first-steps", "--from-literal=mode=warn")
    pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: hello\nspec:\n  containers:\n    - name: main\n      image: busybox\n"
    control_plane.kubectl("create", "-n", "first-steps", "-f", "-", input_text=pod)
    typo = pod.replace("image:", "imagee:")
    refused = control_plane.kubectl("create", "-n", "first-steps", "-f", "-", input_text=typo.replace("hello", "typo"), check=False)
    assert refused.returncode != 0 and 'unknown field "spec.containers[0].imagee"' in refused.stderr, refused.stderr
    assert "containers" in control_plane.kubectl("explain", "pod.spec").stdout
