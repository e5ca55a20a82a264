"""Node agent unit fixtures: a temp host root (library builds and workers: tests/support/nodeagent.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def host_root(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    root.mkdir()
    return root
