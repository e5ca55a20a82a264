"""Fixtures for libvgpu.so tests: build hami-core once per session; helpers live in
vgpu_harness.py next to this file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vgpu_harness import HAMI, node_gpu  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def hamicore_build() -> None:
    """`make test` builds first; building here too keeps `pytest tests/unit/hamicore` self-contained."""
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def node_ledger(tmp_path: Path) -> Iterator[dict[str, str]]:
    """One node-wide fake GPU (a 15 GiB card) for the test: the environment that reaches its ledger."""
    with node_gpu(tmp_path / "node-gpu") as env:
        yield env
