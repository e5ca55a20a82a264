"""Fixtures for node agent tests: two library builds, temp host roots, and real worker
processes that allocate through libvgpu.so against the fake driver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_harness import HAMI, Libraries, make_libraries  # noqa: E402


@pytest.fixture(scope="session")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> Libraries:
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return make_libraries(tmp_path_factory.mktemp("libraries"))


@pytest.fixture
def host_root(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    root.mkdir()
    return root
