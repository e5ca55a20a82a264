"""pytest fixtures on a real node: the control plane plus controller-manager, scheduler, kubelet, containerd and runc.

`real_node` starts one `RealNodeCluster` per session (in a thread with its own event loop, so any test, sync or
async, can use it through kubectl; tests/security/real_node runs on the same one); `cuda_image` is the stand-in for the
seed's `nvidia/cuda` image, pulled from the node's registry. Pods each test makes are deleted after it.
"""

from __future__ import annotations

import sys

import pytest

from kai_isolator.services.devcluster.build import BuildError
from kai_isolator.services.devcluster.images import ImageError
from support.building import build_before_tests
from support.real_node import build_chart_images
from support.real_node import build_node, cuda_image, real_node, real_node_session  # noqa: F401 - fixtures pytest finds by name

CHART_FIXTURES = {"chart_images"}
"""What the fixtures that install the chart or the dev overlay ask for: the images of this tree."""
_chart_failed: list[Exception] = []


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the node's programs and the chart's images before any test runs, as the control plane's are."""
    build_node(config, items)
    chart = build_before_tests(config, items, CHART_FIXTURES, lambda: build_chart_images(sys.stderr), (ImageError, BuildError))
    if isinstance(chart, Exception):
        _chart_failed.append(chart)


@pytest.fixture(scope="session")
def chart_images() -> None:
    """The chart's images of this tree are in the Docker engine (built before the tests ran)."""
    if _chart_failed:
        raise _chart_failed[0]
