"""Fixtures for watcher tests: a sandbox API with a fast simulated node, and a watcher factory on the real bus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.sandbox.settings import SandboxSettings
from kai_isolator.services.watcher.command import running
from kai_isolator.services.watcher.service import PodWatcher
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.bus import provision_stream
from kai_isolator.shared.events import PodIsolation, decode
from kai_isolator.shared.settings import BusSettings


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


class PodEvents:
    """A durable consumer of isolator.pod.>: every event it is handed, in order, acked."""

    def __init__(self) -> None:
        self.received: list[PodIsolation] = []

    def states(self, name: str) -> list[str]:
        return [e.state for e in self.received if e.pod.name == name]

    def count(self) -> int:
        return len(self.received)


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
            except nats.errors.Error:
                await asyncio.sleep(0.1)
                continue
            for msg in batch:
                _, payload = decode(msg.data)
                assert isinstance(payload, PodIsolation)
                events.received.append(payload)
                with contextlib.suppress(nats.errors.Error):
                    await msg.ack()

    task = asyncio.create_task(pump())
    yield events
    stop.set()
    await task
    with contextlib.suppress(Exception):
        await nc.close()


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
