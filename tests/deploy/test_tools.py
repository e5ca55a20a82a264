"""The helm the checks use is built from its pinned Go module, like the control plane; when it cannot be built the
checks fail loudly (never skip)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_tools import ToolError, helm_binary, run_tool

from kai_isolator.services.devcluster import build


def test_helm_is_the_pinned_v4_built_here(helm) -> None:  # the fixture builds it on a fresh machine
    assert helm_binary() == build.entry(build.HELM) / "helm"
    assert run_tool([helm_binary(), "version", "--short"]).strip() == build.HELM.version  # stamped as its release build is


def test_a_helm_that_cannot_be_built_is_an_error_not_a_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An empty cache and no way to download a module: the build must fail, and say so.
    monkeypatch.setenv("KAI_ISOLATOR_KUBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "modules"))
    monkeypatch.setenv("GOPROXY", "off")
    with pytest.raises(ToolError, match="helm could not be built"):
        helm_binary()
    assert not (build.entry(build.HELM) / "helm").exists()
