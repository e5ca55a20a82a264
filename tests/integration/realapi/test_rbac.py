"""deploy/'s RBAC as the real authorizer reads it: each ServiceAccount may do exactly what its service calls, nothing more.

NEEDS lists, per ServiceAccount, every API call its service makes with the shipped arguments (read off the code:
services/*/ and shared/kube_events.py). The authorizer must allow each (sufficient) and the rules it reports for
the account, beyond what every authenticated account gets, must be exactly these (least).
"""

from __future__ import annotations

from typing import Any

import pytest

from kai_isolator.services.devcluster.plane import ControlPlane
from support.pods import make_namespace
from support.webhook import NAMESPACE

Access = tuple[str, str, str, str]  # (apiGroup, resource[/subresource], verb, resourceName or "")
WEBHOOK_TLS = "kai-resource-isolator-webhook-tls"
MUTATING = "kai-resource-isolator-mutating"

NEEDS: dict[str, set[Access]] = {
    # list_pod_for_all_namespaces + its watch; the ConfigMap KAI's binder wrote, read by name.
    "kai-resource-isolator-watcher": {("", "pods", "list", ""), ("", "pods", "watch", ""), ("", "configmaps", "get", "")},
    # The same, field-selected to its node; its Node's GPU memory label; the enforcer's IsolationBreached Events.
    "kai-resource-isolator-nodeagent": {("", "pods", "list", ""), ("", "pods", "watch", ""), ("", "configmaps", "get", ""),
                                        ("", "nodes", "get", ""), ("", "events", "create", "")},
    # Events; the pod condition kai-resource-isolator.io/Isolated (read + replace of pods/status, on by
    # default: --no-pod-condition turns it off); the node view annotation (patch of the Node, on by default).
    "kai-resource-isolator-verifier": {("", "events", "create", ""), ("", "pods/status", "get", ""), ("", "pods/status", "update", ""),
                                       ("", "nodes", "patch", "")},
    # The serving Secret (create cannot name it; read and replace do) and the configuration's caBundle.
    "kai-resource-isolator-certs": {("", "secrets", "create", ""), ("", "secrets", "get", WEBHOOK_TLS), ("", "secrets", "update", WEBHOOK_TLS),
                                    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "get", MUTATING),
                                    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch", MUTATING)},
    # The webhook calls no API at all.
    "kai-resource-isolator-webhook": set(),
}
# Granted by a Role in our namespace only (the certs Job's Secret); everything else is cluster-wide.
IN_OUR_NAMESPACE_ONLY: set[Access] = {a for a in NEEDS["kai-resource-isolator-certs"] if a[1] == "secrets"}


def _rules(plane: ControlPlane, namespace: str, account_ns: str, account: str) -> set[Access]:
    """The account's rules in `namespace`, from the authorizer itself (SelfSubjectRulesReview with its own token)."""
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview", "spec": {"namespace": namespace}}
    answer = plane.service_account_client(account_ns, account).request("POST", "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews", review)
    assert not answer["status"].get("incomplete"), answer["status"]
    found = set()
    for rule in answer["status"]["resourceRules"]:
        for group in rule.get("apiGroups") or [""]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [""]:
                        found.add((group, resource, verb, name))
    return found


def _allowed(plane: ControlPlane, account: str, access: Access, namespace: str) -> bool:
    group, resource, verb, name = access
    resource, _, subresource = resource.partition("/")
    attributes: dict[str, Any] = {"group": group, "resource": resource, "subresource": subresource, "verb": verb, "name": name}
    if resource not in ("nodes", "mutatingwebhookconfigurations"):
        attributes["namespace"] = namespace
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
              "spec": {"user": f"system:serviceaccount:{NAMESPACE}:{account}", "resourceAttributes": attributes,
                       "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}", "system:authenticated"]}}
    return bool(plane.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)["status"]["allowed"])


@pytest.fixture(scope="module")
def baseline(control_plane: ControlPlane, deployed: list[dict[str, Any]]) -> dict[str, set[Access]]:
    """What any ServiceAccount may do with no binding of its own (discovery, self-reviews), per namespace looked at."""
    namespace = make_namespace(control_plane, "baseline")
    control_plane.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody"}})
    return {ns: _rules(control_plane, ns, namespace, "nobody") for ns in (NAMESPACE, "default")}


def test_every_service_account_in_the_manifests_is_covered(deployed: list[dict[str, Any]]) -> None:
    accounts = {d["metadata"]["name"] for d in deployed if d["kind"] == "ServiceAccount"}
    assert accounts == set(NEEDS)


@pytest.mark.parametrize("account", sorted(NEEDS))
def test_rbac_is_sufficient(control_plane: ControlPlane, deployed: list[dict[str, Any]], account: str) -> None:
    refused = [access for access in sorted(NEEDS[account])
               if not _allowed(control_plane, account, access, NAMESPACE if access in IN_OUR_NAMESPACE_ONLY else "default")]
    assert refused == [], f"{account} may not make calls its service makes: {refused}"


@pytest.mark.parametrize("account", sorted(NEEDS))
def test_rbac_is_least(control_plane: ControlPlane, deployed: list[dict[str, Any]], baseline: dict[str, set[Access]], account: str) -> None:
    for namespace in (NAMESPACE, "default"):
        granted = _rules(control_plane, namespace, NAMESPACE, account) - baseline[namespace]
        expected = {a for a in NEEDS[account] if namespace == NAMESPACE or a not in IN_OUR_NAMESPACE_ONLY}
        assert granted == expected, f"{account} in {namespace}: more than needed {sorted(granted - expected)}, " \
                                    f"less than needed {sorted(expected - granted)}"
