"""Fixtures for the attacks on the real node (kubelet, containerd, runc; the GPU faked at the driver level only): the one
real node of the test process, which tests/realnode shares, and the stand-in of the CUDA image (support/real_node.py)."""

from __future__ import annotations

import pytest

from support.real_node import build_node, cuda_image, real_node, real_node_session  # noqa: F401 - fixtures pytest finds by name


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    build_node(config, items)
