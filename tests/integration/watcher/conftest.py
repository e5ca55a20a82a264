"""Fixtures for watcher tests: the real API server (`dev_cluster`, with KAI and a fast GPU node simulated through it)
and a watcher factory on the real bus, plus waits for what only an API call can tell."""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from kai_isolator.services.devcluster.cluster import ApiCallError, DevCluster
from kai_isolator.services.watcher.command import running
from kai_isolator.services.watcher.service import PodWatcher
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared.settings import BusSettings
from pod_events import PodEvents, pod_events  # noqa: F401  (the fixture, shared with other suites)


@pytest.fixture
def watcher_settings(dev_cluster: DevCluster) -> WatcherSettings:
    # The real API server sends a watch's bookmark only shortly before its timeoutSeconds ends (not every 0.2 s as the
    # former in-process API did), so a read timeout under the watch timeout would call every quiet watch dead and re-open it.
    return WatcherSettings(
        kubeconfig=dev_cluster.kubeconfig, watch_timeout_s=30, read_timeout_s=45, connect_timeout_s=2,
        backoff_base_s=0.05, backoff_max_s=0.5, resume_save_interval_s=0.2, lease_ttl_s=2.0,
    )


@pytest.fixture
async def start_watcher(bus_settings: BusSettings, watcher_settings: WatcherSettings) -> AsyncIterator[Callable[..., Any]]:
    """Start watchers (stopped gracefully at teardown, unless the test already stopped or killed them)."""
    stacks: list[contextlib.AsyncExitStack] = []

    async def factory(**overrides: Any) -> tuple[PodWatcher, contextlib.AsyncExitStack]:
        stack = contextlib.AsyncExitStack()
        stacks.append(stack)
        settings = watcher_settings.model_copy(update=overrides)
        watcher = await stack.enter_async_context(running(settings, bus_settings, bus_settings.nats_url or ""))
        await asyncio.wait_for(watcher.synced.wait(), 20)
        return watcher, stack

    yield factory
    for stack in reversed(stacks):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(stack.aclose(), 15)


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """`support.eventually` for a condition read through the API; fail the test if it does not hold in time."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


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

    await until(reached)


async def delete_for_good(cluster: DevCluster, name: str, namespace: str = "default") -> None:
    """Delete a pod and wait until it is gone: on a real API server a bound pod's deletion is graceful, and the
    object stays (with a deletionTimestamp) until its node's kubelet confirms that the containers stopped."""
    await cluster.delete("pods", namespace, name)
    await cluster.wait_gone("pods", namespace, name, timeout_s=20)


def gpu_pod(name: str, *, node: str | None = "gpu-node-1", annotations: dict[str, str] | None = None, injected: bool = False, **extra: Any) -> dict[str, Any]:
    """A pod asking for a GPU share, optionally already carrying the webhook's library mount (our webhook is not
    registered on `dev_cluster`, so the mount stands for its work); `node=None` leaves it unschedulable, Pending."""
    container: dict[str, Any] = {"name": "main", "image": "busybox"}
    spec: dict[str, Any] = {"containers": [container]}
    if node:  # KAI's (it admits only pods that name its scheduler), placed on `node`
        spec["schedulerName"] = "kai-scheduler"
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if injected:
        spec["volumes"] = [{"name": "kai-resource-isolator-vgpu", "hostPath": {"path": "/usr/local/vgpu", "type": "Directory"}}]
        container["volumeMounts"] = [{"name": "kai-resource-isolator-vgpu", "mountPath": "/etc/ld.so.preload", "subPath": "ld.so.preload", "readOnly": True}]
    return {"metadata": {"name": name, "annotations": {"gpu-memory": "4096", **(annotations or {})}, **extra}, "spec": spec}


@pytest.fixture
async def dev_cluster(dev_cluster: DevCluster) -> AsyncIterator[DevCluster]:
    """`dev_cluster` with the simulated KAI's per-GPU booking off: these tests run more 4096 MiB pods on one simulated
    T4 than KAI would place (three), and test something else (tests/integration/devcluster/test_kai_simulation.py
    tests the booking)."""
    assert dev_cluster.scheduler is not None
    dev_cluster.scheduler.options = dataclasses.replace(dev_cluster.scheduler.options, book_capacity=False)
    yield dev_cluster
