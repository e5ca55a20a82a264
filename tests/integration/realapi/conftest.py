"""Fixtures for services on the real API server: a GPU node, and the watcher under its own ServiceAccount on the real bus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kai_isolator.services.devcluster.plane import ControlPlane
from control_plane.fixtures import NAMESPACE
from kai_isolator.services.watcher.command import running
from kai_isolator.services.watcher.service import PodWatcher
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared.settings import BusSettings
from pod_events import PodEvents, pod_events  # noqa: F401  (the fixture, shared with other suites)


@pytest.fixture
async def start_watcher(control_plane: ControlPlane, deployed: list[dict[str, Any]], bus_settings: BusSettings
                        ) -> AsyncIterator[Callable[..., Any]]:
    """Start watchers as the watcher's ServiceAccount, with the RBAC deploy/ grants it (and nothing else)."""
    kubeconfig = control_plane.service_account_kubeconfig(NAMESPACE, "kai-resource-isolator-watcher")
    stacks: list[contextlib.AsyncExitStack] = []

    async def factory(**overrides: Any) -> tuple[PodWatcher, contextlib.AsyncExitStack]:
        settings = WatcherSettings(kubeconfig=kubeconfig, watch_timeout_s=30, read_timeout_s=5, connect_timeout_s=2,
                                   backoff_base_s=0.05, backoff_max_s=0.5, resume_save_interval_s=0.2).model_copy(update=overrides)
        stack = contextlib.AsyncExitStack()
        stacks.append(stack)
        watcher = await stack.enter_async_context(running(settings, bus_settings, bus_settings.nats_url or ""))
        await asyncio.wait_for(watcher.synced.wait(), 20)
        return watcher, stack

    yield factory
    for stack in reversed(stacks):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(stack.aclose(), 15)


