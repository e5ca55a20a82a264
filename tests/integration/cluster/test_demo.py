"""`kai-isolator dev --demo` on a three-node R3 cluster (a comma-separated KAI_ISOLATOR_NATS_URL) whose stream
leader is SIGKILLed midway: the demo still ends `demo complete`, and every pod's story is in the stream once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest

from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import ClusterMember, EmbeddedCluster
from kai_isolator.shared.events import AdmissionDecision, PodIsolation

from .conftest import stream_events, stream_leader


async def restart_later(member: ClusterMember) -> None:
    """Back after a while, as a restarted pod of the StatefulSet would be."""
    await asyncio.sleep(3)
    await asyncio.to_thread(member.start)


@pytest.mark.timeout(300)
async def test_the_demo_completes_through_a_stream_leader_killed_midway(nats_cluster: EmbeddedCluster, tmp_path: Path) -> None:
    env = {**os.environ, "KAI_ISOLATOR_NATS_URL": nats_cluster.url, "KAI_ISOLATOR_NATS_REPLICAS": "3", "TMPDIR": str(tmp_path)}
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kai_isolator.services.cli", "dev", "--demo", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    assert demo.stdout is not None and demo.stderr is not None
    errors = asyncio.create_task(demo.stderr.read())
    out: list[str] = []
    killed: ClusterMember | None = None
    restart: asyncio.Task[None] | None = None
    try:
        while line := (await asyncio.wait_for(demo.stdout.readline(), 150)).decode():
            out.append(line)
            if killed is None and line.startswith("1. "):  # every service is up and the first pod is on its way
                killed = await stream_leader(nats_cluster)
                killed.kill()
                restart = asyncio.create_task(restart_later(killed))
        assert await asyncio.wait_for(demo.wait(), 60) == 0, "".join(out) + (await errors).decode()[-3000:]
    finally:
        if demo.returncode is None:
            os.killpg(demo.pid, signal.SIGKILL)
            await demo.wait()
    text = "".join(out)
    assert killed is not None and "demo complete" in text and "demo FAILED" not in text, text
    assert restart is not None
    await restart
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
