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
    CHART, HELM_VARIANTS, KUSTOMIZE_VARIANTS, NAMESPACE, RELEASE, Docs, ToolError, helm_binary, kubectl_binary, release_tools, run_tool,
    set_flags,
)
from support.building import build_before_tests  # noqa: E402

TOOL_FIXTURES = {"helm", "render_helm", "rendered", "release_tools_built"}
_tools_failed: list[Exception] = []


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build helm and the registry before any test runs (a fresh machine's first builds take minutes), outside every
    test's timeout."""
    built = build_before_tests(config, items, TOOL_FIXTURES, release_tools, ToolError)
    if isinstance(built, Exception):
        _tools_failed.append(built)


@pytest.fixture(scope="session")
def release_tools_built() -> tuple[Path, Path]:
    """helm and the registry (built before the tests ran)."""
    if _tools_failed:
        raise _tools_failed[0]
    return release_tools()


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Run the cached helm binary with private cache/config/data dirs (nothing from this machine leaks in)."""
    if _tools_failed:
        raise _tools_failed[0]
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
