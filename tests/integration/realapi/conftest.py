"""Fixtures for services on the real API server: a GPU node, and the watcher under its own ServiceAccount on the real
bus (support.watcher's `start_watcher` on these settings)."""

from __future__ import annotations

from typing import Any

import pytest

from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.services.watcher.settings import WatcherSettings
from support.bus import PodEvents, pod_events  # noqa: F401  (the fixture, shared with other suites)
from support.watcher import start_watcher  # noqa: F401  (the fixture, on this folder's watcher_settings)
from support.webhook import NAMESPACE


@pytest.fixture
def watcher_settings(control_plane: ControlPlane, deployed: list[dict[str, Any]]) -> WatcherSettings:
    """The watcher as its ServiceAccount, with the RBAC deploy/ grants it (and nothing else)."""
    kubeconfig = control_plane.service_account_kubeconfig(NAMESPACE, "kai-resource-isolator-watcher")
    return WatcherSettings(kubeconfig=kubeconfig, watch_timeout_s=30, read_timeout_s=5, connect_timeout_s=2,
                           backoff_base_s=0.05, backoff_max_s=0.5, resume_save_interval_s=0.2)
