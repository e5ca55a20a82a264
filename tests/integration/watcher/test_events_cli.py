"""`kai-isolator events` shows the watcher's stream of a pod on the real API server."""

from __future__ import annotations

import asyncio
import os
import sys

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.shared.settings import BusSettings
from support.pods import T4, gpu_pod
from support.waiting import eventually

from .conftest import PodEvents


async def test_events_command_shows_pod_story(dev_cluster: DevCluster, bus_settings: BusSettings, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await dev_cluster.create("pods", gpu_pod("shown", node=T4, injected=True), "default")
    await eventually(lambda: pod_events.states("shown") == ["admitted", "scheduled", "running"])
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kai_isolator.services.cli", "events", "--subject", "isolator.pod.>", "--since", "1h", "--limit", "3",
        env={**os.environ, "KAI_ISOLATOR_NATS_URL": bus_settings.nats_url or ""}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    lines = out.decode().splitlines()
    assert process.returncode == 0, err.decode()
    assert [line.split()[1] for line in lines] == ["io.kai-isolator.pod.admitted.v1", "io.kai-isolator.pod.scheduled.v1", "io.kai-isolator.pod.running.v1"]
    assert all("default/shown" in line for line in lines)
    assert "expected_limit=4147m" in lines[-1]
