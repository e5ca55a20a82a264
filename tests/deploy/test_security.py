"""Security is correctness: least privilege in every rendering. Only the node agent is privileged in any way."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import pytest
from deploy_tools import NO_NRI_VARIANTS, NRI_CONTAINER, REPO, Docs, component, containers, pod_specs

ALL_VARIANTS = ["kustomize/base", "kustomize/cert-manager", "kustomize/dev", "helm/default", "helm/optional", "helm/minimal",
               "kustomize/nats-cluster", "helm/nats-cluster", *NO_NRI_VARIANTS]
AGENT_CAPABILITIES = {"SYS_PTRACE", "DAC_READ_SEARCH", "KILL"}
# Host directories that must never be handed to the NRI plugin as "the directory of containerd's NRI socket": they hold
# the runtime's own sockets (containerd.sock is the node).
RUNTIME_DIRS = {"/", "/run", "/var/run", "/var", "/tmp", "/etc", "/run/containerd", "/var/run/containerd", "/run/crio", "/var/run/crio"}
READ_VERBS = {"get", "list", "watch"}
# Components that call no Kubernetes API must not even get a token.
NO_API = {"webhook", "installer"}
# What the node agent reads to compute grants (its node's pods, field-selected; their ConfigMaps; its
# node) and the enforcer's IsolationBreached Events.
NODEAGENT_ACCESS = {("pods", "list"), ("pods", "watch"), ("configmaps", "get"), ("nodes", "get"),
                    ("events", "create")}


def _pod_security(spec: dict, container: dict) -> dict:
    """A container's effective security settings (container fields win over the pod's)."""
    return {**spec.get("securityContext", {}), **container.get("securityContext", {})}


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_only_the_node_agent_is_privileged_in_any_way(rendered: dict[str, Docs], variant: str) -> None:
    agents = 0
    for doc, spec in pod_specs(rendered[variant]):
        name, agent = doc["metadata"]["name"], component(doc) == "nodeagent"
        agents += agent
        assert not spec.get("hostNetwork") and not spec.get("hostIPC"), name
        assert bool(spec.get("hostPID")) == agent, f"{name}: hostPID is for the node agent only"
        host_paths = [v for v in spec.get("volumes", []) if "hostPath" in v]
        assert not host_paths or agent, f"{name} mounts host paths"
        for container in containers(spec):
            security = _pod_security(spec, container)
            where = f"{name}/{container['name']}"
            assert security.get("privileged") is not True, where
            assert security.get("allowPrivilegeEscalation") is False, where
            assert security.get("readOnlyRootFilesystem") is True, where
            assert "ALL" in security.get("capabilities", {}).get("drop", []), where
            added = set(security.get("capabilities", {}).get("add", []))
            # The NRI plugin beside the agent opens two root-owned sockets as their owner: no capability at all.
            assert added <= (AGENT_CAPABILITIES if agent and container["name"] != NRI_CONTAINER else set()), f"{where} adds {added}"
            assert security.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
            if not agent:
                assert security.get("runAsNonRoot") is True and security.get("runAsUser") != 0, f"{where} may run as root"
    assert agents == 1


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_node_agent_host_paths_are_the_library_state_grants_read_only_dev_and_what_nri_needs(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    (agent,) = [(d, s) for d, s in pod_specs(docs) if component(d) == "nodeagent"]
    doc, spec = agent
    webhook = next(d for d in docs if d["kind"] == "Deployment" and component(d) == "webhook")
    args = dict(a[2:].split("=", 1) for a in webhook["spec"]["template"]["spec"]["containers"][0]["args"][1:])
    injected = {args["container-vgpu-mount"], args["state-dir"], args["grant-dir"]}
    volumes = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for c in containers(spec) for m in c.get("volumeMounts", [])}
    mounted_by = {name: {c["name"] for c in containers(spec) for m in c.get("volumeMounts", []) if m["name"] == name} for name in volumes}
    plugin = next((c for c in containers(spec) if c["name"] == NRI_CONTAINER), None)
    agent_env = {e["name"]: e.get("value") for e in next(c for c in spec["containers"] if c["name"] == "nodeagent").get("env", [])}
    for name, host_path in volumes.items():
        path = host_path["path"]
        if path == "/dev":
            assert mounts[name].get("readOnly") is True, "/dev must be read-only"
            continue
        # NRI, deliberately: the agent opens a container's cgroup v2 leaf by the host's full path to set the driver's cap
        # (creation.unified_leaf, only on the decision socket's StartContainer), so it sees the host's hierarchy, read-only
        # and where the host has it; nothing else does, and only where it answers an NRI plugin at all.
        if path == "/sys/fs/cgroup":
            assert mounted_by[name] == {"nodeagent"} and mounts[name]["mountPath"] == path, "the host's cgroups: the agent's, at the host's path"
            assert mounts[name].get("readOnly") is True, "the agent opens a cgroup leaf, it never writes one"
            assert agent_env.get("KAI_ISOLATOR_NRI_SOCKET"), "the host's cgroups serve the driver's cap, which only NRI's StartContainer sets"
            continue
        # NRI, deliberately: the directory of containerd's NRI socket, to the plugin alone and read-only (a socket is connected
        # to on a read-only mount), and never a directory that holds the runtime's own sockets.
        if plugin is not None and name in {m["name"] for m in plugin["volumeMounts"]}:
            socket = next(a.split("=", 1)[1] for a in plugin["args"] if a.startswith("--nri-socket="))
            assert path == str(PurePosixPath(socket).parent) and path not in RUNTIME_DIRS, f"the NRI plugin mounts {path} for {socket}"
            assert mounted_by[name] == {NRI_CONTAINER} and mounts[name].get("readOnly") is True, "containerd's NRI socket: the plugin's, read-only"
            continue
        # Only what the webhook injects into pods: the library dir and (the parent of) the state dir.
        assert any(i == path or i.startswith(path + "/") for i in injected), f"agent mounts unrelated host path {path}"
        assert path not in ("/", "/etc", "/usr", "/var", "/var/lib", "/proc", "/sys"), path
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, "the agent belongs on GPU nodes only"


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_every_container_has_resources(rendered: dict[str, Docs], variant: str) -> None:
    for doc, spec in pod_specs(rendered[variant]):
        for container in containers(spec):
            resources = container.get("resources", {})
            where = f"{doc['metadata']['name']}/{container['name']}"
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{where} has no cpu/memory requests"
            assert "memory" in resources.get("limits", {}), f"{where} has no memory limit"


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_no_token_where_no_api_is_called(rendered: dict[str, Docs], variant: str) -> None:
    for doc, spec in pod_specs(rendered[variant]):
        if component(doc) in NO_API:
            assert spec.get("automountServiceAccountToken") is False, doc["metadata"]["name"]


def _rules(docs: Docs, name_suffix: str) -> list[dict]:
    return [r for d in docs if d["kind"] in ("Role", "ClusterRole") and d["metadata"]["name"].endswith(name_suffix) for r in d["rules"]]


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_rbac_is_least_privilege(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    for doc in docs:
        if doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule.get(key, []), f"{doc['metadata']['name']}: wildcard {key}"
                assert not {"escalate", "bind", "impersonate", "delete", "deletecollection"} & set(rule["verbs"]), doc["metadata"]["name"]
                if "secrets" in rule["resources"]:
                    assert doc["metadata"]["name"].endswith("-certs"), f"{doc['metadata']['name']} touches Secrets"
                    assert rule["verbs"] == ["create"] or rule.get("resourceNames"), "Secret reads must name the Secret"
                assert "pods/eviction" not in rule["resources"] or doc["metadata"]["name"].endswith(("-verifier", "-nodeagent")), \
                    "only the verifier and the enforcer evict"
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            (subject,) = doc["subjects"]
            assert subject["kind"] == "ServiceAccount" and subject["name"] == doc["roleRef"]["name"]
            assert not any(subject["name"].endswith(f"-{c}") for c in NO_API), f"{subject['name']} needs no RBAC"
    for rule in _rules(docs, "-watcher"):
        assert set(rule["verbs"]) <= READ_VERBS and set(rule["resources"]) <= {"pods", "configmaps"}
    agent_rules = _rules(docs, "-nodeagent")
    assert {(r, v) for rule in agent_rules for r in rule["resources"] for v in rule["verbs"]} <= NODEAGENT_ACCESS
    assert all(rule["apiGroups"] == [""] for rule in agent_rules)
    if any(d["kind"] == "ClusterRole" for d in docs if d["metadata"]["name"].endswith("-watcher")):  # RBAC rendered at all
        assert {(r, v) for rule in agent_rules for r in rule["resources"] for v in rule["verbs"]} == NODEAGENT_ACCESS
    verifier_args = {a for d, s in pod_specs(docs) for c in containers(s) for a in c.get("args", [])}
    for rule in _rules(docs, "-verifier"):
        # Events, plus the pod condition kai-resource-isolator.io/Isolated and the node views kubectl isolator reads.
        allowed = {("events", "create"), ("pods/status", "get"), ("pods/status", "update"), ("nodes", "patch")}
        allowed |= {("pods", "patch")} if "--on-missing=annotate" in verifier_args else set()
        allowed |= {("pods/eviction", "create")} if "--on-missing=evict" in verifier_args else set()
        assert {(r, v) for r in rule["resources"] for v in rule["verbs"]} <= allowed, rule
    for rule in _rules(docs, "-certs"):
        if "mutatingwebhookconfigurations" in rule["resources"]:
            assert rule["resourceNames"] and set(rule["verbs"]) <= {"get", "patch"}


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_webhook_configuration_fails_closed_on_a_narrow_match(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    (mwc,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    (hook,) = mwc["webhooks"]
    assert mwc["metadata"]["name"] == "kai-resource-isolator-mutating"
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"], hook["reinvocationPolicy"]) == ("Fail", "None", 5, "IfNeeded")
    (rule,) = hook["rules"]
    # UPDATE: the GPU-request annotations the node grants from may not change once the pod exists.
    assert (rule["operations"], rule["resources"], rule["apiGroups"]) == (["CREATE", "UPDATE"], ["pods"], [""])
    (condition,) = hook["matchConditions"]
    expression = condition["expression"]
    assert re.search(r"'gpu-fraction' in object\.metadata\.annotations", expression)
    assert re.search(r"'gpu-memory' in object\.metadata\.annotations", expression)
    assert re.search(r"'gpu-memory' in oldObject\.metadata\.annotations", expression)  # an update that drops them is seen too
    # a pod without annotations, and a CREATE (no oldObject), must not error (= fail)
    assert expression.startswith("(has(object.metadata.annotations) &&") and "oldObject != null && has(oldObject.metadata.annotations) &&" in expression
    selector = {e["key"]: e for e in hook["namespaceSelector"]["matchExpressions"]}
    assert selector["kai-resource-isolator.io/webhook"] == {"key": "kai-resource-isolator.io/webhook", "operator": "NotIn", "values": ["ignore"]}
    own = hook["clientConfig"]["service"]["namespace"]
    excluded = selector["kubernetes.io/metadata.name"]
    assert excluded["operator"] == "NotIn" and {"kube-system", own} <= set(excluded["values"])
    assert "objectSelector" not in hook, "a pod label opt-out is one any tenant could flip"


def test_webhook_stays_available_through_drains(rendered: dict[str, Docs]) -> None:
    docs = rendered["kustomize/base"]
    webhook = next(d for d in docs if d["kind"] == "Deployment" and component(d) == "webhook")
    assert webhook["spec"]["replicas"] >= 2 and webhook["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert webhook["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= webhook["spec"]["template"]["metadata"]["labels"].items()


def _stages(dockerfile: str) -> list[tuple[str, str]]:
    """(base image, body) of each build stage."""
    parts = re.split(r"^FROM\s+", (REPO / "deploy" / "docker" / dockerfile).read_text(), flags=re.M)[1:]
    return [(p.split()[0], p) for p in parts]


@pytest.mark.parametrize(("dockerfile", "user"), [("Dockerfile", "65532:65532"), ("Dockerfile.nodeagent", "0:0"),
                                                  ("Dockerfile.devcluster", "65532:65532")])
def test_images_run_kai_isolator_and_keep_build_tools_out(dockerfile: str, user: str) -> None:
    stages = _stages(dockerfile)
    final_image, final = stages[-1]
    assert "cuda" not in final_image and "devel" not in final_image, "CUDA devel image in the final stage"
    assert "GO_IMAGE" not in final_image and "golang" not in final_image, "the Go toolchain in the final stage"
    assert re.findall(r"^USER (\S+)$", final, re.M) == [user]
    assert re.search(r'^ENTRYPOINT \["kai-isolator"\]$', final, re.M)
    if dockerfile == "Dockerfile.nodeagent":
        assert any("cuda" in image and "devel" in image for image, _ in stages[:-1]), "libvgpu.so is built in a CUDA devel stage"
