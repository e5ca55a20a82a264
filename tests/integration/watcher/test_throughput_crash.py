"""A backlog of pods through the pipelined watcher on the real API server, SIGKILLed with many pods in flight:
after the restart every pod's story is on the stream whole, in order, each fact once."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.shared.settings import BusSettings
from support.bus import PodEvents, pod_events  # noqa: F401  (the fixture)
from support.pods import gpu_pod, make_namespace
from support.processes import start_service
from support.waiting import eventually

STORY = ["admitted", "isolation-missing"]  # not KAI's scheduler's, and our webhook is not registered: never bound, never injected


def create_pods(plane: ControlPlane, namespace: str, names: list[str]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: plane.request("POST", f"/api/v1/namespaces/{namespace}/pods", gpu_pod(n, scheduler=None)), names))


# The pipelined watcher's knobs: lanes in parallel, resume points saved often, a short lease. Not waited on once
# started: the backlog is what it meets first.
WATCHER_ENV = {"KAI_ISOLATOR_WATCHER_RESUME_SAVE_INTERVAL_S": "0.2", "KAI_ISOLATOR_WATCHER_RESUME_SAVE_EVERY": "50",
               "KAI_ISOLATOR_WATCHER_LEASE_TTL_S": "2", "KAI_ISOLATOR_WATCHER_LANES": "16", "KAI_ISOLATOR_LOG_LEVEL": "warning"}


@pytest.mark.timeout(240)
async def test_killed_with_many_pods_in_flight_loses_reorders_and_repeats_nothing(dev_cluster: DevCluster, bus_settings: BusSettings,
                                                                                   pod_events: PodEvents, tmp_path: Path) -> None:  # noqa: F811
    # dev_cluster's plane, not control_plane: deploy/'s webhook (failurePolicy Fail) there may point at no webhook.
    control_plane = dev_cluster.plane
    assert control_plane is not None
    ns = make_namespace(control_plane, "burst")
    first_names = [f"p-{i}" for i in range(600)]
    await asyncio.to_thread(create_pods, control_plane, ns, first_names)
    args, env = ["watcher", "--kubeconfig", str(control_plane.admin_kubeconfig)], {"KAI_ISOLATOR_NATS_URL": bus_settings.nats_url or "", **WATCHER_ENV}
    watcher = (await start_service(args, env, tmp_path, ready=None)).process
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
    watcher = (await start_service(args, env, tmp_path, ready=None)).process
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
