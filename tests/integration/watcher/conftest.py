"""Fixtures for watcher tests: a sandbox API with a fast simulated node, and a watcher factory on the real bus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.sandbox.settings import SandboxSettings
from kai_isolator.services.watcher.command import running
from kai_isolator.services.watcher.service import PodWatcher
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared.settings import BusSettings
from pod_events import PodEvents, pod_events  # noqa: F401  (the fixture, shared with other suites)


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[SandboxApi]:
    settings = SandboxSettings(kubeconfig=tmp_path / "kubeconfig", bookmark_interval_s=0.2, node_step_s=0.02, retained_events=10_000)
    async with SandboxApi(settings) as api:
        yield api


@pytest.fixture
def watcher_settings(sandbox: SandboxApi) -> WatcherSettings:
    return WatcherSettings(
        kubeconfig=sandbox.settings.kubeconfig, watch_timeout_s=30, read_timeout_s=5, connect_timeout_s=2,
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


def gpu_pod(name: str, *, node: str | None = "gpu-node-1", annotations: dict[str, str] | None = None, injected: bool = False, **extra: Any) -> dict[str, Any]:
    """A pod asking for a GPU share, optionally already carrying the webhook's library mount."""
    container: dict[str, Any] = {"name": "main", "image": "busybox"}
    spec: dict[str, Any] = {"containers": [container]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if injected:
        spec["volumes"] = [{"name": "kai-resource-isolator-vgpu", "hostPath": {"path": "/usr/local/vgpu", "type": "Directory"}}]
        container["volumeMounts"] = [{"name": "kai-resource-isolator-vgpu", "mountPath": "/etc/ld.so.preload", "subPath": "ld.so.preload", "readOnly": True}]
    return {"metadata": {"name": name, "annotations": {"gpu-memory": "4096", **(annotations or {})}, **extra}, "spec": spec}
