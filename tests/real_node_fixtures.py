"""The real node's fixtures, for the conftests of the folders whose tests run on it (tests/realnode, tests/security/real_node)
to import: the process's one node (real_node_support.one_real_node), a test's hold on it that deletes the pods the test
made, and the CUDA image stand-in. `build_node` builds the node's programs before any test runs."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from kai_isolator.services.devcluster.build import BuildError, ensure_node
from real_node_support import Node, import_cuda_image, one_real_node
from support import build_before_tests

_built: list[object] = []


def build_node(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the node's programs before any test runs, as the control plane's are; once a process, whichever conftest asks."""
    if _built:
        return
    built = build_before_tests(config, items, {"real_node_session"}, lambda: ensure_node(sys.stderr), BuildError)
    if built is not None:
        _built.append(built)


@pytest.fixture(scope="session")
def real_node_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    if _built and isinstance(_built[0], BuildError):
        raise _built[0]
    with one_real_node(tmp_path_factory.mktemp("real-node")) as node:
        yield node


@pytest.fixture
def real_node(real_node_session: Node) -> Iterator[Node]:
    """The session's real node; the pods a test applied through it are gone after the test."""
    try:
        yield real_node_session
    finally:
        real_node_session.clean()


@pytest.fixture(scope="session")
def cuda_image(real_node_session: Node, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The stand-in of the seed's `nvidia/cuda` image in the node's containerd (real_node_support.import_cuda_image)."""
    return import_cuda_image(real_node_session, tmp_path_factory.mktemp("images"))
