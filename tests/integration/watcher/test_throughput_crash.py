"""A backlog of pods through the pipelined watcher on the real API server, SIGKILLed with many pods in flight:
after the restart every pod's story is on the stream whole, in order, each fact once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from control_plane.fixtures import make_namespace
from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.shared.ports import free_port
from kai_isolator.shared.settings import BusSettings
from pod_events import PodEvents, pod_events  # noqa: F401  (the fixture)
from support import eventually

STORY = ["admitted", "isolation-missing"]  # not KAI's scheduler's, and our webhook is not registered: never bound, never injected


def gpu_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": {"gpu-memory": "4096"}},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}


def create_pods(plane: ControlPlane, namespace: str, names: list[str]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: plane.request("POST", f"/api/v1/namespaces/{namespace}/pods", gpu_pod(n)), names))


async def start_watcher(kubeconfig: Path, bus: BusSettings, log: Path) -> asyncio.subprocess.Process:
    env = {**os.environ, "KAI_ISOLATOR_NATS_URL": bus.nats_url or "", "KAI_ISOLATOR_WATCHER_RESUME_SAVE_INTERVAL_S": "0.2",
           "KAI_ISOLATOR_WATCHER_RESUME_SAVE_EVERY": "50", "KAI_ISOLATOR_WATCHER_LEASE_TTL_S": "2", "KAI_ISOLATOR_WATCHER_LANES": "16",
           "KAI_ISOLATOR_LOG_LEVEL": "warning"}
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kai_isolator.services.watcher", "--kubeconfig", str(kubeconfig), "--probe-listen", f"127.0.0.1:{free_port()}",
            env=env, stdout=out, stderr=out)


@pytest.mark.timeout(240)
async def test_killed_with_many_pods_in_flight_loses_reorders_and_repeats_nothing(dev_cluster: DevCluster, bus_settings: BusSettings,
                                                                                   pod_events: PodEvents, tmp_path: Path) -> None:  # noqa: F811
    # dev_cluster's plane, not control_plane: deploy/'s webhook (failurePolicy Fail) there may point at no webhook.
    control_plane = dev_cluster.plane
    assert control_plane is not None
    ns = make_namespace(control_plane, "burst")
    first_names = [f"p-{i}" for i in range(600)]
    await asyncio.to_thread(create_pods, control_plane, ns, first_names)
    watcher = await start_watcher(control_plane.admin_kubeconfig, bus_settings, tmp_path / "watcher.log")
    try:
        await eventually(lambda: pod_events.count() >= 300, timeout_s=60)
    finally:
        watcher.send_signal(signal.SIGKILL)  # mid-backlog: lanes with records written and events not yet out
        await watcher.wait()

    # Deleted while no watcher runs: a relist the kill interrupted must still hear of them (their DELETED).
    doomed = first_names[:25]
    for name in doomed:
        control_plane.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}")
    later = [f"q-{i}" for i in range(100)]
    await asyncio.to_thread(create_pods, control_plane, ns, later)
    watcher = await start_watcher(control_plane.admin_kubeconfig, bus_settings, tmp_path / "watcher.log")
    try:
        def complete() -> bool:
            return (all(pod_events.states(n, ns)[:2] == STORY for n in first_names + later)
                    and all("deleted" in pod_events.states(n, ns) for n in doomed))

        await eventually(complete, timeout_s=90)
    finally:
        watcher.send_signal(signal.SIGTERM)
        await watcher.wait()
    for name in first_names + later:
        assert pod_events.states(name, ns) == STORY + (["deleted"] if name in doomed else []), name
    repeated = [key for key, n in Counter((e.pod.uid, e.state) for e in pod_events.received).items() if n > 1]
    assert repeated == []
