"""What the tests share, one module a concern; docs/development.md ("The test layout") says which lives where.

Tests import the modules by name (`from support.pods import gpu_pod`): `tests/` is on the path (pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root."""
