"""Fixtures for watcher tests: the real API server (`dev_cluster`, with KAI and a fast GPU node simulated through it)
and a watcher factory on the real bus (support.watcher's `start_watcher` on these settings), plus waits for what only
an API call can tell."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from kai_isolator.services.devcluster.cluster import ApiCallError, DevCluster
from kai_isolator.services.watcher.settings import WatcherSettings
from support.bus import PodEvents, pod_events  # noqa: F401  (the fixture, shared with other suites)
from support.waiting import eventually
from support.watcher import start_watcher  # noqa: F401  (the fixture, on this folder's watcher_settings)


@pytest.fixture
def watcher_settings(dev_cluster: DevCluster) -> WatcherSettings:
    # The real API server sends a watch's bookmark only shortly before its timeoutSeconds ends (not every 0.2 s as the
    # former in-process API did), so a read timeout under the watch timeout would call every quiet watch dead and re-open it.
    return WatcherSettings(
        kubeconfig=dev_cluster.kubeconfig, watch_timeout_s=30, read_timeout_s=45, connect_timeout_s=2,
        backoff_base_s=0.05, backoff_max_s=0.5, resume_save_interval_s=0.2, lease_ttl_s=2.0,
    )


async def phase(cluster: DevCluster, name: str, namespace: str = "default") -> str | None:
    """The pod's phase, or None once it is gone for good."""
    try:
        pod = await cluster.get("pods", namespace, name)
    except ApiCallError as error:
        if error.code == 404:
            return None
        raise
    return str((pod.get("status") or {}).get("phase") or "") or None


async def wait_phase(cluster: DevCluster, name: str, wanted: str, namespace: str = "default") -> None:
    async def reached() -> bool:
        return await phase(cluster, name, namespace) == wanted

    await eventually(reached)


async def delete_for_good(cluster: DevCluster, name: str, namespace: str = "default") -> None:
    """Delete a pod and wait until it is gone: on a real API server a bound pod's deletion is graceful, and the
    object stays (with a deletionTimestamp) until its node's kubelet confirms that the containers stopped."""
    await cluster.delete("pods", namespace, name)
    await cluster.wait_gone("pods", namespace, name, timeout_s=20)


@pytest.fixture
async def dev_cluster(dev_cluster: DevCluster) -> AsyncIterator[DevCluster]:
    """`dev_cluster` with the simulated KAI's per-GPU booking off: these tests run more 4096 MiB pods on one simulated
    T4 than KAI would place (three), and test something else (tests/integration/devcluster/test_kai_simulation.py
    tests the booking)."""
    assert dev_cluster.scheduler is not None
    dev_cluster.scheduler.options = dataclasses.replace(dev_cluster.scheduler.options, book_capacity=False)
    yield dev_cluster
