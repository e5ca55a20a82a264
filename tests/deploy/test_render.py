"""Every shipped rendering is valid Kubernetes for 1.29-1.33; helm lint passes; chart and kustomize agree; PDB values behave."""

from __future__ import annotations

import json
from collections.abc import Callable

import kubernetes_validate
import pytest
import yaml
from deploy_tools import (
    CHART, HELM_OPTIONAL, HELM_VARIANTS, KUSTOMIZE_VARIANTS, NRI_CONTAINER, REPO, Docs, ToolError, containers, pod_specs, set_flags,
)

KUBE_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
VARIANTS = [*KUSTOMIZE_VARIANTS, *HELM_VARIANTS]
# Custom resources have no upstream schema; these are the only ones we ship, checked by hand below.
CUSTOM_KINDS = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate")}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_object_validates_strictly(rendered: dict[str, Docs], variant: str, kube_version: str) -> None:
    docs = rendered[variant]
    assert docs, f"{variant} rendered nothing"
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']} invalid for {kube_version} at "
                        f"{'.'.join(map(str, error.path))}: {error.message}")


@pytest.mark.parametrize("variant", ["kustomize/cert-manager", "helm/optional"])
def test_cert_manager_objects_are_well_formed(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    certificates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    assert set(((d["apiVersion"], d["kind"]) for d in docs if d["apiVersion"].startswith("cert-manager.io"))) <= CUSTOM_KINDS
    for cert in certificates.values():
        assert cert["spec"]["issuerRef"]["name"] in issuers and cert["spec"]["secretName"]
    serving = next(c for c in certificates.values() if not c["spec"].get("isCA"))
    ca = next(c for c in certificates.values() if c["spec"].get("isCA"))
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    assert ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    webhook = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-webhook"))
    secret_names = {v["secret"]["secretName"] for v in webhook["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert serving["spec"]["secretName"] in secret_names
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-webhook"))
    ns = service["metadata"]["namespace"]
    assert f"{service['metadata']['name']}.{ns}.svc" in serving["spec"]["dnsNames"]
    mwc = next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{ns}/{serving['metadata']['name']}"
    assert not [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("-certs")], "certs Job next to cert-manager"


@pytest.mark.parametrize("values", [{}, HELM_OPTIONAL], ids=["default", "optional"])
def test_helm_lint_strict(helm: Callable[..., str], values: dict[str, str]) -> None:
    out = helm("lint", "--strict", str(CHART), *set_flags(values))
    assert "0 chart(s) failed" in out


def _shape(docs: Docs) -> dict[tuple[str, str], dict]:
    """What must match between chart and kustomize: each object's identity and each container's command line."""
    shape = {}
    for doc in docs:
        if doc["kind"] == "Namespace":
            continue  # helm installs into a namespace it does not own (--create-namespace)
        if "test" in doc["metadata"].get("annotations", {}).get("helm.sh/hook", "").split(","):
            continue  # `helm test`'s pod: created by `helm test` alone, never installed
        entry: dict = {}
        for _, spec in pod_specs([doc]):
            entry = {c["name"]: c.get("args", []) for c in containers(spec)}
        if doc["kind"] in ("ClusterRole", "Role"):
            entry = {"rules": doc["rules"]}
        shape[(doc["kind"], doc["metadata"]["name"])] = entry
    return shape


def _release_objects(docs: Docs) -> Docs:
    """Without the pre-install Secret Job, which only Helm needs (its `--wait` would otherwise wait on the webhook forever)."""
    return [d for d in docs if "pre-install" not in d["metadata"].get("annotations", {}).get("helm.sh/hook", "").split(",")
            or d["kind"] != "Job"]


def test_chart_defaults_render_what_the_kustomize_base_renders(rendered: dict[str, Docs]) -> None:
    assert _shape(_release_objects(rendered["helm/default"])) == _shape(rendered["kustomize/base"])


def test_helm_certs_hooks_make_the_secret_before_the_webhook_and_patch_after_the_configuration(rendered: dict[str, Docs]) -> None:
    docs = rendered["helm/default"]
    hooks = {(d["kind"], d["metadata"]["name"]): d["metadata"]["annotations"] for d in docs
             if "helm.sh/hook" in d["metadata"].get("annotations", {})}
    phases = {key: set(a["helm.sh/hook"].split(",")) for key, a in hooks.items()}
    secret_job, patch_job = ("Job", "kai-resource-isolator-certs-secret"), ("Job", "kai-resource-isolator-certs")
    assert phases[secret_job] == {"pre-install", "pre-upgrade"} and phases[patch_job] == {"post-install", "post-upgrade"}
    jobs = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["args"] for d in docs if d["kind"] == "Job"}
    assert "--webhook-config=" in jobs[secret_job[1]], "at pre-install the configuration does not exist yet"
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        annotations = hooks[(kind, "kai-resource-isolator-certs")]
        assert phases[(kind, "kai-resource-isolator-certs")] == phases[secret_job] | phases[patch_job], kind
        assert int(annotations["helm.sh/hook-weight"]) < 0, f"{kind} must exist before the Jobs run"


def _nri_parts(docs: Docs) -> dict:
    """What NRI adds to a rendering: the agent pod's containers as they run (mounts and env by name), its volumes, and
    the webhook's env."""
    [agent] = [s for d, s in pod_specs(docs) if d["kind"] == "DaemonSet" and d["metadata"]["name"].endswith("-nodeagent")]
    [webhook] = [s for d, s in pod_specs(docs) if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-webhook")]

    def running(c: dict) -> dict:
        return {"command": c.get("command"), "args": c.get("args"), "securityContext": c.get("securityContext"),
                "resources": c.get("resources"), "env": {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])},
                "mounts": {m["name"]: m for m in c.get("volumeMounts", [])}}

    return {"containers": {c["name"]: running(c) for c in agent["containers"]}, "volumes": {v["name"]: v for v in agent["volumes"]},
            "webhook env": {e["name"]: e.get("value") for e in webhook["containers"][0].get("env", [])}}


@pytest.mark.parametrize(("chart", "overlay"), [({}, "kustomize/base"), ({"nodeAgent.nri.enabled": "false"}, "kustomize/no-nri")],
                         ids=["nri", "no-nri"])
def test_chart_and_kustomize_agree_on_nri(render_helm: Callable[..., Docs], rendered: dict[str, Docs], chart: dict[str, str],
                                          overlay: str) -> None:
    """The chart's default is the base (NRI on), nodeAgent.nri.enabled=false the no-nri overlay: the same plugin, mounts,
    volumes, security and env, not only the same command lines."""
    docs = render_helm(chart)
    assert _shape(_release_objects(docs)) == _shape(rendered[overlay])
    assert _nri_parts(docs) == _nri_parts(rendered[overlay])


NRI_ARGS = ["--name=kai-isolator", "--idx=10", "--nri-socket=/var/run/nri/nri.sock", "--agent-socket=/run/kai-isolator/nri.sock",
            "--reconnect=5s"]


def test_nri_on_adds_the_plugin_its_sockets_and_the_webhooks_requirement(render_helm: Callable[..., Docs]) -> None:
    on = _nri_parts(render_helm({}))  # the default
    assert list(on["containers"]) == ["nodeagent", NRI_CONTAINER]
    plugin, agent = on["containers"][NRI_CONTAINER], on["containers"]["nodeagent"]
    assert (plugin["command"], plugin["args"]) == (["kai-isolator-nri"], NRI_ARGS)
    assert plugin["securityContext"]["capabilities"] == {"drop": ["ALL"]} and plugin["securityContext"]["readOnlyRootFilesystem"]
    assert {name: (m["mountPath"], m.get("readOnly")) for name, m in plugin["mounts"].items()} == {
        "nri-agent": ("/run/kai-isolator", True), "nri-socket": ("/var/run/nri", True)}
    assert on["volumes"]["nri-socket"]["hostPath"] == {"path": "/var/run/nri", "type": "DirectoryOrCreate"}
    assert "emptyDir" in on["volumes"]["nri-agent"]
    assert agent["env"]["KAI_ISOLATOR_NRI_SOCKET"] == "/run/kai-isolator/nri.sock"
    assert (agent["mounts"]["nri-agent"]["mountPath"], agent["mounts"]["cgroup"]["mountPath"]) == ("/run/kai-isolator", "/sys/fs/cgroup")
    assert agent["mounts"]["cgroup"]["readOnly"] is True and on["volumes"]["cgroup"]["hostPath"]["path"] == "/sys/fs/cgroup"
    assert on["webhook env"] == {"KAI_ISOLATOR_REQUIRE_NRI_PLUGIN": "kai-isolator"}


def test_nri_off_leaves_none_of_it(render_helm: Callable[..., Docs]) -> None:
    off = _nri_parts(render_helm({"nodeAgent.nri.enabled": "false"}))
    assert list(off["containers"]) == ["nodeagent"]
    agent = off["containers"]["nodeagent"]
    assert "KAI_ISOLATOR_NRI_SOCKET" not in agent["env"] and not {"nri-agent", "cgroup"} & set(agent["mounts"])
    assert not {"nri-agent", "nri-socket", "cgroup"} & set(off["volumes"])
    assert off["webhook env"] == {}


@pytest.mark.parametrize(("values", "idx", "socket_dir"), [
    ({"nodeAgent.nri.index": "7"}, "07", "/var/run/nri"),  # --set makes it a number: written with two digits
    ({"nodeAgent.nri.index": "0"}, "00", "/var/run/nri"),  # the default, "10", is the string form
    ({"nodeAgent.nri.socketPath": "/run/k3s/nri/nri.sock"}, "10", "/run/k3s/nri"),
], ids=lambda v: str(v))
def test_nri_index_and_socket_reach_the_plugin(render_helm: Callable[..., Docs], values: dict[str, str], idx: str, socket_dir: str) -> None:
    parts = _nri_parts(render_helm(values))
    args = parts["containers"][NRI_CONTAINER]["args"]
    assert f"--idx={idx}" in args and any(a.startswith(f"--nri-socket={socket_dir}/") for a in args), args
    assert parts["volumes"]["nri-socket"]["hostPath"]["path"] == socket_dir


@pytest.mark.parametrize("values", [
    {"nodeAgent.nri.socketPath": "nri.sock"}, {"nodeAgent.nri.socketPath": "/nri.sock"}, {"nodeAgent.nri.socketPath": "/var/run/nri/"},
    {"nodeAgent.nri.index": "-1"}, {"nodeAgent.nri.index": "100"}, {"nodeAgent.nri.enabled": "yes"},
], ids=lambda v: str(v))
def test_nri_values_the_schema_refuses(render_helm: Callable[..., Docs], values: dict[str, str]) -> None:
    with pytest.raises(ToolError, match="values don't meet the specifications of the schema"):
        render_helm(values)


def test_chart_with_cert_manager_matches_the_overlay(render_helm: Callable[..., Docs], rendered: dict[str, Docs]) -> None:
    chart = render_helm({"tls.certManager.enabled": "true", "tls.patch.enabled": "false"})
    assert _shape(chart) == _shape(rendered["kustomize/cert-manager"])


def _pdbs(docs: Docs) -> list[dict]:
    return [d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"]


@pytest.mark.parametrize(("values", "expected"), [
    ({"webhook.replicaCount": "1"}, []),
    ({}, [{"minAvailable": 1}]),
    ({"webhook.podDisruptionBudget.maxUnavailable": "0"}, [{"maxUnavailable": 0}]),
    ({"webhook.podDisruptionBudget.maxUnavailable": "50%"}, [{"maxUnavailable": "50%"}]),
    ({"webhook.podDisruptionBudget.minAvailable": "2"}, [{"minAvailable": 2}]),
    ({"webhook.podDisruptionBudget.minAvailable": "null"}, [{"minAvailable": 1}]),
    ({"webhook.podDisruptionBudget": "null"}, [{"minAvailable": 1}]),
    ({"webhook.podDisruptionBudget.maxUnavailable": "abc"}, [{"minAvailable": 1}]),
    ({"webhook.podDisruptionBudget.maxUnavailable": "-1"}, [{"minAvailable": 1}]),
    ({"webhook.podDisruptionBudget.maxUnavailable": "150%"}, [{"minAvailable": 1}]),
    ({"webhook.podDisruptionBudget.maxUnavailable": "2147483648"}, [{"minAvailable": 1}]),
], ids=lambda v: str(v))
def test_pdb_follows_upstream_precedence(render_helm: Callable[..., Docs], values: dict[str, str], expected: list[dict]) -> None:
    got = [{k: v for k, v in spec.items() if k != "selector"} for spec in _pdbs(render_helm(values))]
    assert got == expected


@pytest.mark.parametrize(("values", "message"), [
    ({"webhook.failurePolicy": "Sometimes"}, "webhook.failurePolicy must be Fail or Ignore"),
    ({"webhook.policy": "strict"}, "webhook.policy must be enforce, warn or off"),
    ({"verifier.onMissing": "delete"}, "verifier.onMissing must be warn, annotate or evict"),
    ({"installer.rollout.version": "v1.2"}, "installer.rollout.version must be 16 lowercase hex digits"),
    ({"paths.grantDir": "grants"}, "paths.grantDir must be an absolute path"),
    ({"paths.grantDir": "/var/lib/kai-isolator/containers/grants"}, "must not contain or be inside the tenant-writable state dir"),
    ({"paths.grantDir": "/var/lib"}, "must not contain or be inside the tenant-writable state dir"),
    # Its directory is mounted into the plugin: never one that holds the runtime's own sockets.
    ({"nodeAgent.nri.socketPath": "/run/containerd/nri.sock"}, "keep the socket in a directory of its own"),
    ({"nodeAgent.nri.socketPath": "/var/run/nri.sock"}, "keep the socket in a directory of its own"),
    ({"nodeAgent.nri.socketPath": "/var/run/nri/../containerd/nri.sock"}, "must be a clean absolute path"),
])
def test_bad_values_fail_with_a_clear_message(render_helm: Callable[..., Docs], values: dict[str, str], message: str) -> None:
    with pytest.raises(ToolError, match=message):
        render_helm(values)


def test_evict_grants_the_verifier_only_the_eviction_subresource(render_helm: Callable[..., Docs]) -> None:
    docs = render_helm({"verifier.onMissing": "evict"})
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    evicting = [d["metadata"]["name"] for d in roles for r in d["rules"] if "pods/eviction" in r["resources"]]
    assert evicting == ["kai-resource-isolator-verifier"]
    [verifier] = [d for d in roles if d["metadata"]["name"] == "kai-resource-isolator-verifier"]
    # Besides eviction: its Events, the pod condition (pods/status) and the node views (nodes patch).
    assert {(res, verb) for r in verifier["rules"] for res in r["resources"] for verb in r["verbs"]} == {
        ("events", "create"), ("pods/eviction", "create"), ("pods/status", "get"), ("pods/status", "update"), ("nodes", "patch")}
    args = [a for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
    assert "--on-missing=evict" in args


def test_evict_on_breach_grants_the_node_agent_the_eviction_subresource(render_helm: Callable[..., Docs]) -> None:
    default = [d for d in render_helm({}) if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-nodeagent")]
    assert not [r for d in default for r in d["rules"] if "pods/eviction" in r["resources"]]
    docs = render_helm({"nodeAgent.onBreach": "evict"})
    [agent] = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-nodeagent")]
    assert ("pods/eviction", "create") in {(res, verb) for r in agent["rules"] for res in r["resources"] for verb in r["verbs"]}
    args = [a for d in docs if d["kind"] == "DaemonSet" for c in d["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
    assert "--on-breach=evict" in args


def test_readiness_gate_splits_the_namespaces_between_two_webhook_entries(render_helm: Callable[..., Docs]) -> None:
    def webhooks(values: dict[str, str]) -> list[dict]:
        [config] = [d for d in render_helm(values) if d["kind"] == "MutatingWebhookConfiguration"]
        return config["webhooks"]

    [plain] = webhooks({})  # off by default: one entry, no gate anywhere
    assert "readiness-gate" not in str(plain["namespaceSelector"])
    entries = {w["name"]: w for w in webhooks({"webhook.readinessGate.enabled": "true"})}
    plain, gated = entries["vgpu.lib.kai-resource-isolator.io"], entries["gated.vgpu.lib.kai-resource-isolator.io"]
    label = "kai-resource-isolator.io/readiness-gate"
    assert {"key": label, "operator": "NotIn", "values": ["true"]} in plain["namespaceSelector"]["matchExpressions"]
    assert {"key": label, "operator": "In", "values": ["true"]} in gated["namespaceSelector"]["matchExpressions"]
    assert (plain["clientConfig"]["service"]["path"], gated["clientConfig"]["service"]["path"]) == ("/mutate", "/mutate-gated")
    for key in ("rules", "matchConditions", "failurePolicy", "reinvocationPolicy"):
        assert plain[key] == gated[key], key  # the same narrow match, only the namespaces differ


def test_monitoring_renders_only_when_asked_and_matches_the_plain_files(render_helm: Callable[..., Docs]) -> None:
    kinds = {"ServiceMonitor", "PrometheusRule"}
    assert not [d for d in render_helm({}) if d["kind"] in kinds]  # off by default: no CRD needed
    docs = render_helm({"monitoring.serviceMonitor.enabled": "true", "monitoring.prometheusRule.enabled": "true",
                        "monitoring.dashboard.enabled": "true"})
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sorted(d["metadata"]["name"].rsplit("-", 1)[-1] for d in monitors) == ["nodeagent", "verifier", "watcher", "webhook"]
    for monitor in monitors:  # each selects a Service that really is rendered, on a port it has
        selector = monitor["spec"]["selector"]["matchLabels"]
        port = monitor["spec"]["endpoints"][0]["port"]
        services = [d for d in docs if d["kind"] == "Service" and selector.items() <= d["metadata"].get("labels", {}).items()]
        assert services and all(port in [p.get("name") for p in s["spec"]["ports"]] for s in services), monitor["metadata"]["name"]
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    plain = yaml.safe_load((REPO / "deploy" / "monitoring" / "prometheus-rules.yaml").read_text())
    assert rule["spec"]["groups"] == plain["groups"]
    [dashboard] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert json.loads(next(iter(dashboard["data"].values()))) == json.loads((REPO / "deploy" / "monitoring" / "grafana-dashboard.json").read_text())
