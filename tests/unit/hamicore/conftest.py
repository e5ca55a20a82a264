"""Fixtures for libvgpu.so tests: build hami-core once per session; helpers live in
vgpu_harness.py next to this file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vgpu_harness import HAMI  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def hamicore_build() -> None:
    """`make test` builds first; building here too keeps `pytest tests/unit/hamicore` self-contained."""
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
