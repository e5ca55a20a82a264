"""Rendered deploy manifests (kustomize base and overlays, Helm with default and optional values), once per session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make the sibling helper module importable
from deploy_tools import (  # noqa: E402
    CHART, HELM_VARIANTS, KUSTOMIZE_VARIANTS, NAMESPACE, RELEASE, Docs, helm_binary, kubectl_binary, run_tool, set_flags,
)


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
