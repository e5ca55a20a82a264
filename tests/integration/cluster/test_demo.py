"""`kai-isolator dev --demo` on a three-node R3 cluster (a comma-separated KAI_ISOLATOR_NATS_URL) that loses one server
midway for good, as a NATS pod lost with its node: the stream's leader, a KV bucket's leader, or the server the webhook
is connected to, SIGKILLed as the first pod is created and kept down for the rest of the demo, at least DOWN_S. Two
servers of three are a quorum: the demo still ends `demo complete`, and once the server is back every pod's story is
in the stream, each fact once. The services run with the shipped defaults (only the URLs and the replica count set):
how fast they fail over is what an operator gets."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest

from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import ClusterMember, EmbeddedCluster
from kai_isolator.shared.events import AdmissionDecision, PodIsolation

from .conftest import stream_events, stream_leader

DOWN_S = 60.0
"""How long the lost server stays away at least: minutes in a real cluster; a minute is already twice the longest
wait of any demo step (30 s), so a stall for as long as the server is away fails the demo."""

WEBHOOK_CONNECTION = "admission"  # the webhook's bus connection, named after its service


async def victim(cluster: EmbeddedCluster, role: str) -> ClusterMember:
    """The member that plays `role` now. The bucket is the watcher's pod records, written ahead of every event of every
    story; its leadership is moved off the stream's leader, so this fault is the bucket's alone."""
    stream = await stream_leader(cluster)
    if role == "stream leader":
        return stream
    if role == "bucket leader":
        return await cluster.step_down(f"KV_{WatcherSettings().state_bucket}", {stream.server_name})
    return await asyncio.to_thread(cluster.serving, WEBHOOK_CONNECTION)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("role", ["stream leader", "bucket leader", "webhook's server"])
async def test_the_demo_completes_with_a_server_lost_for_good(nats_cluster: EmbeddedCluster, tmp_path: Path, role: str) -> None:
    env = {**os.environ, "KAI_ISOLATOR_NATS_URL": nats_cluster.url, "KAI_ISOLATOR_NATS_REPLICAS": "3", "TMPDIR": str(tmp_path)}
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kai_isolator.services.cli", "dev", "--demo", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    assert demo.stdout is not None and demo.stderr is not None
    errors = asyncio.create_task(demo.stderr.read())
    loop = asyncio.get_running_loop()
    out: list[str] = []
    killed: ClusterMember | None = None
    killed_at = 0.0
    try:
        while line := (await asyncio.wait_for(demo.stdout.readline(), 150)).decode():
            out.append(line)
            if killed is None and line.startswith("1. "):  # every service is up and the first pod is on its way
                killed = await victim(nats_cluster, role)
                killed.kill()
                killed_at = loop.time()
        assert await asyncio.wait_for(demo.wait(), 60) == 0, "".join(out) + (await errors).decode()[-3000:]
    finally:
        if demo.returncode is None:
            os.killpg(demo.pid, signal.SIGKILL)
            await demo.wait()
    text = "".join(out)
    assert killed is not None and "demo complete" in text and "demo FAILED" not in text, text
    # The outage itself lasts DOWN_S whatever the demo did meanwhile: a duration of the fault, not a wait for a condition.
    await asyncio.sleep(max(0.0, killed_at + DOWN_S - loop.time()))
    await asyncio.to_thread(killed.start)  # back, as a rescheduled pod of the StatefulSet would be, and caught up
    events = await stream_events(nats_cluster.url, subjects.ALL_ADMISSION) + await stream_events(nats_cluster.url, subjects.ALL_PODS)
    admitted = {e.pod_name for e in events if isinstance(e, AdmissionDecision)}
    stories: dict[str, list[str]] = {}
    for e in events:
        if isinstance(e, PodIsolation):
            stories.setdefault(e.pod.name, []).append(e.state)
    assert {"gpu-sharing-demo", "opted-out", "webhook-was-down", "bypass-demo"} <= stories.keys(), stories
    assert {"gpu-sharing-demo", "opted-out", "bypass-demo"} <= admitted, admitted
    for name, states in stories.items():
        assert states[:1] == ["admitted"] and "scheduled" in states and "running" in states, (name, states)
    decisions = Counter(e.request_uid for e in events if isinstance(e, AdmissionDecision))
    facts = Counter((e.pod.uid, e.state) for e in events if isinstance(e, PodIsolation))
    assert [k for k, n in (decisions + facts).items() if n > 1] == []  # each decision and each fact once
