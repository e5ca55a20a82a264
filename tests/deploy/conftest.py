"""Rendered deploy manifests (kustomize base and overlays, Helm with default and optional values), once per session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make the sibling helper module importable
from deploy_tools import REPO, helm_binary, kubectl_binary, run_tool  # noqa: E402

CHART = REPO / "deploy" / "helm" / "kai-resource-isolator"
KUSTOMIZE = REPO / "deploy" / "kustomize"
RELEASE = NAMESPACE = "kai-resource-isolator"

KUSTOMIZE_VARIANTS = {
    "kustomize/base": KUSTOMIZE / "base",
    "kustomize/cert-manager": KUSTOMIZE / "overlays" / "cert-manager",
    "kustomize/dev": KUSTOMIZE / "overlays" / "dev",
}
# Every optional value at once, so each conditional template renders at least once.
HELM_OPTIONAL = {
    "tls.certManager.enabled": "true", "tls.patch.enabled": "false", "nats.enabled": "true",
    "verifier.onMissing": "annotate", "installer.rollout.version": "0123456789abcdef", "installer.rollout.nodes": "gpu-a\\,gpu-b",
    "bus.envSecret": "nats-env", "bus.credsSecret": "nats-creds", "bus.tlsSecret": "nats-tls", "bus.tlsClientCert": "true",
    "global.imageRegistry": "registry.example.com", "global.imagePullSecrets[0].name": "regcred",
    "webhook.replicaCount": "3", "webhook.podDisruptionBudget.maxUnavailable": "1", "webhook.podLabels.team": "gpu",
    "webhook.podAnnotations.note": "x", "nodeAgent.podLabels.team": "gpu", "webhook.nodeSelector.pool": "system",
    "webhook.tolerations[0].operator": "Exists", "watcher.nodeSelector.pool": "system", "paths.containerVgpuMount": "/opt/vgpu",
"webhook.policy": "enforce", "webhook.allowPodOptOut": "false",
}
HELM_VARIANTS = {
    "helm/default": {},
    "helm/optional": HELM_OPTIONAL,
    "helm/minimal": {"webhook.replicaCount": "1", "watcher.enabled": "false", "verifier.enabled": "false", "rbac.create": "false"},
}

Docs = list[dict]


def set_flags(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Run the cached helm binary with private cache/config/data dirs (nothing from this machine leaks in)."""
    binary = helm_binary()
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data")}

    def run(*args: str) -> str:
        return run_tool([binary, *args], env=env)

    return run


@pytest.fixture(scope="session")
def render_helm(helm: Callable[..., str]) -> Callable[..., Docs]:
    def render(values: dict[str, str], kube_version: str = "1.33.0") -> Docs:
        out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version, *set_flags(values))
        return [d for d in yaml.safe_load_all(out) if d]

    return render


@pytest.fixture(scope="session")
def kustomize() -> Callable[[Path], Docs]:
    kubectl = kubectl_binary()

    def render(path: Path) -> Docs:
        return [d for d in yaml.safe_load_all(run_tool([kubectl, "kustomize", str(path)])) if d]

    return render


@pytest.fixture(scope="session")
def rendered(render_helm: Callable[..., Docs], kustomize: Callable[[Path], Docs]) -> dict[str, Docs]:
    """Every variant we ship, by name."""
    out = {name: kustomize(path) for name, path in KUSTOMIZE_VARIANTS.items()}
    out.update({name: render_helm(values) for name, values in HELM_VARIANTS.items()})
    return out


def pod_specs(docs: Docs) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every object that runs pods."""
    found = []
    for doc in docs:
        kind = doc["kind"]
        if kind in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            found.append((doc, doc["spec"]["template"]["spec"]))
        elif kind == "Pod":
            found.append((doc, doc["spec"]))
    return found


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def component(doc: dict) -> str:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") or doc["metadata"]["name"]
