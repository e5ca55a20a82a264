"""Restarts, 410 Gone and NATS outages: every change reaches a durable consumer exactly once."""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter

from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.settings import BusSettings
from support import eventually

from .conftest import PodEvents, gpu_pod

FULL_STORY = ["admitted", "isolation-missing", "scheduled", "running"]


def assert_exactly_once(events: PodEvents) -> None:
    seen = Counter((e.pod.uid, e.state) for e in events.received)
    assert [key for key, n in seen.items() if n > 1] == []


async def test_killed_mid_stream_and_restarted_loses_and_repeats_nothing(sandbox: SandboxApi, bus_settings: BusSettings, watcher_settings: WatcherSettings, start_watcher, pod_events: PodEvents) -> None:
    env = {**os.environ, "KAI_ISOLATOR_NATS_URL": bus_settings.nats_url or "", "KAI_ISOLATOR_WATCHER_RESUME_SAVE_INTERVAL_S": "0.2", "KAI_ISOLATOR_WATCHER_LEASE_TTL_S": "2", "KAI_ISOLATOR_LOG_LEVEL": "warning"}
    first = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kai_isolator.services.cli", "watcher", "--kubeconfig", str(watcher_settings.kubeconfig), "--probe-listen", "127.0.0.1:0", env=env,
    )
    try:
        await sandbox.create("pods", gpu_pod("job-0"), "default")
        await eventually(lambda: pod_events.count() >= 2, timeout_s=60)  # the process is up and watching
        for i in range(1, 40):
            await sandbox.create("pods", gpu_pod(f"job-{i}"), "default")
        await eventually(lambda: pod_events.count() >= 30)
    finally:
        first.kill()  # SIGKILL mid-stream: no graceful stop, no final save
        await first.wait()

    for i in range(40, 50):
        await sandbox.create("pods", gpu_pod(f"job-{i}"), "default")
    await eventually(lambda: sandbox.get("pods", "default", "job-0")["status"]["phase"] == "Running")
    sandbox.delete("pods", "default", "job-0")
    await start_watcher()
    await sandbox.create("pods", gpu_pod("job-50"), "default")

    names = [f"job-{i}" for i in range(51)]
    await eventually(lambda: all(pod_events.states(n)[:4] == FULL_STORY for n in names) and "deleted" in pod_events.states("job-0"), timeout_s=30)
    assert_exactly_once(pod_events)
    assert pod_events.states("job-0") == [*FULL_STORY, "deleted"]
    assert all(pod_events.states(n) == FULL_STORY for n in names[1:])


async def test_410_gone_relists_and_reconciles_missed_changes(sandbox: SandboxApi, start_watcher, pod_events: PodEvents) -> None:
    _, stack = await start_watcher()
    for name in ("keep", "doomed", "finishing"):
        await sandbox.create("pods", gpu_pod(name), "default")
    await eventually(lambda: all(pod_events.states(n) == FULL_STORY for n in ("keep", "doomed", "finishing")))
    await stack.aclose()  # graceful: the resume version is saved

    sandbox.delete("pods", "default", "doomed")
    sandbox.nodes.finish("default", "finishing", 1)
    await sandbox.create("pods", gpu_pod("newcomer", node=None), "default")
    sandbox.compact()  # the saved resume version is now older than the server keeps

    watcher, _ = await start_watcher()
    await eventually(lambda: "deleted" in pod_events.states("doomed") and "finished" in pod_events.states("finishing") and pod_events.states("newcomer"))
    assert watcher.metrics.relists._value.get() == 1  # it resumed, met 410 Gone, and relisted once
    assert pod_events.states("doomed") == [*FULL_STORY, "deleted"]
    assert pod_events.states("finishing") == [*FULL_STORY, "finished"]
    assert pod_events.states("newcomer") == ["admitted", "isolation-missing"]
    assert pod_events.states("keep") == FULL_STORY
    assert_exactly_once(pod_events)


async def test_nats_outage_during_churn_loses_nothing(sandbox: SandboxApi, nats_server: EmbeddedNats, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await sandbox.create("pods", gpu_pod("before"), "default")
    await eventually(lambda: pod_events.states("before") == FULL_STORY)

    await asyncio.to_thread(nats_server.stop)
    for i in range(15):
        await sandbox.create("pods", gpu_pod(f"during-{i}"), "default")
    await eventually(lambda: all(sandbox.get("pods", "default", f"during-{i}")["status"]["phase"] == "Running" for i in range(15)))
    sandbox.delete("pods", "default", "before")
    sandbox.delete("pods", "default", "during-0")
    await asyncio.to_thread(nats_server.start)

    await eventually(lambda: all(pod_events.states(f"during-{i}")[:4] == FULL_STORY for i in range(15)) and "deleted" in pod_events.states("during-0") and "deleted" in pod_events.states("before"), timeout_s=40)
    assert pod_events.states("during-0") == [*FULL_STORY, "deleted"]
    assert pod_events.states("before") == [*FULL_STORY, "deleted"]
    assert_exactly_once(pod_events)
