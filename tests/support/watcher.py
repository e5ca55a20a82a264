"""The watcher in the test's own event loop: the `start_watcher` fixture, for the conftests whose folders provide
`watcher_settings` (their API server and the identity the watcher lists it as) to import."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from kai_isolator.services.watcher.command import running
from kai_isolator.services.watcher.service import PodWatcher
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared.settings import BusSettings

WatcherFactory = Callable[..., Awaitable[tuple[PodWatcher, contextlib.AsyncExitStack]]]


@pytest.fixture
async def start_watcher(bus_settings: BusSettings, watcher_settings: WatcherSettings) -> AsyncIterator[WatcherFactory]:
    """Start watchers on `watcher_settings` changed by the factory's keywords, each returned once it has listed
    (stopped gracefully at teardown, unless the test already stopped or killed it through its exit stack)."""
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
