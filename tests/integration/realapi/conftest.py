"""Fixtures for services on the real API server: a GPU node, and the watcher under its own ServiceAccount on the real bus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from control_plane.cluster import ControlPlane
from control_plane.fixtures import NAMESPACE
from control_plane.node import GpuNode
from kai_isolator.services.watcher.command import running
from kai_isolator.services.watcher.service import PodWatcher
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.bus import provision_stream
from kai_isolator.shared.events import PodIsolation, decode
from kai_isolator.shared.settings import BusSettings


@pytest.fixture(scope="session")
def gpu_node(control_plane: ControlPlane) -> GpuNode:
    """One simulated T4 (15360 MiB), registered by its own kubelet identity."""
    return GpuNode(control_plane, "gpu-node-1", 15360)


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


class PodEvents:
    """Every isolator.pod.> event a durable consumer is handed, in order."""

    def __init__(self) -> None:
        self.received: list[PodIsolation] = []

    def states(self, namespace: str, name: str) -> list[str]:
        return [e.state for e in self.received if e.pod.namespace == namespace and e.pod.name == name]


@pytest.fixture
async def pod_events(bus_settings: BusSettings) -> AsyncIterator[PodEvents]:
    nc = await nats.connect(bus_settings.nats_url or "", max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream()
    await provision_stream(js, bus_settings)
    events = PodEvents()
    config = ConsumerConfig(durable_name="test-pod-events", ack_policy=AckPolicy.EXPLICIT, filter_subject=subjects.ALL_PODS)
    psub = await js.pull_subscribe(subjects.ALL_PODS, durable="test-pod-events", stream=subjects.STREAM_NAME, config=config)
    stop = asyncio.Event()

    async def pump() -> None:
        while not stop.is_set():
            try:
                batch = await psub.fetch(256, timeout=0.3)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            for msg in batch:
                _, payload = decode(msg.data)
                assert isinstance(payload, PodIsolation)
                events.received.append(payload)
                await msg.ack()

    task = asyncio.create_task(pump())
    yield events
    stop.set()
    await task
    await nc.close()
