"""Rollouts across five node agents (five temp host roots) on a real nats-server."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import nats.errors
import pytest

from kai_isolator.services.installer import rollout
from kai_isolator.services.nodeagent import install
from kai_isolator.services.nodeagent.layout import version_of
from kai_isolator.shared import subjects
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.events import RolloutProgress, decode
from kai_isolator.shared.settings import BusSettings
from support.bus import RuntimeFactory
from support.nodeagent import Libraries

NODES = [f"gpu-node-{i}" for i in range(1, 6)]
BUCKETS = [rollout.NODE_BUCKET, rollout.ROLLOUT_BUCKET]


def install_requests(agent) -> float:
    value = agent.runtime.metrics.registry.get_sample_value(
        "kai_isolator_bus_messages_total", {"handler": subjects.node_install(agent.node), "outcome": "ok"})
    return value or 0.0


async def rollout_events(runtime) -> list[RolloutProgress]:
    psub = await runtime.jetstream.pull_subscribe(subjects.ALL_ROLLOUTS, stream=subjects.STREAM_NAME)
    events: list[RolloutProgress] = []
    try:
        while True:
            batch = await psub.fetch(100, timeout=0.5)
            events += [p for _, p in map(lambda m: decode(m.data), batch) if isinstance(p, RolloutProgress)]
    except (asyncio.TimeoutError, nats.errors.TimeoutError):
        pass  # drained
    await psub.unsubscribe()
    return events


async def test_rollout_halts_at_the_node_that_fails_its_self_check_then_resumes(start_agent, start_runtime: RuntimeFactory, libraries: Libraries) -> None:
    agents = {node: await start_agent(node, self_check_command=["/bin/false"] if node == "gpu-node-3" else None) for node in NODES}
    v1, v2 = version_of(libraries.v1.read_bytes()), version_of(libraries.v2.read_bytes())
    driver = await start_runtime("installer", kv_buckets=BUCKETS)

    state = await rollout.run_rollout(driver, v2, max_unavailable=1, node_timeout_s=30)

    assert state.phase == "halted" and state.failed_node == "gpu-node-3" and "probe exited 1" in state.message
    assert state.done == ["gpu-node-1", "gpu-node-2"]
    assert [install.active_version(agents[n].layout) for n in NODES] == [v2, v2, v2, v1, v1]  # 4 and 5 never touched
    assert [install_requests(agents[n]) for n in NODES] == [1, 1, 1, 0, 0]
    halted = [e for e in await rollout_events(driver) if e.phase == "halted"]
    assert [(e.node_name, e.done_nodes) for e in halted] == [("gpu-node-3", ["gpu-node-1", "gpu-node-2"])]

    # The operator fixes node 3; a new driver (as after a restart) resumes from KV without redoing 1 and 2.
    agents["gpu-node-3"].settings = agents["gpu-node-3"].settings.model_copy(update={"self_check_command": None})
    again = await start_runtime("installer", kv_buckets=BUCKETS)
    state = await rollout.run_rollout(again, v2, max_unavailable=2, node_timeout_s=30)
    assert state.phase == "completed" and state.done == NODES
    assert all(install.active_version(a.layout) == v2 for a in agents.values())
    assert [install_requests(agents[n]) for n in NODES] == [1, 1, 2, 1, 1]


async def test_nodes_already_there_are_skipped_and_bad_input_refused(start_agent, start_runtime: RuntimeFactory, libraries: Libraries) -> None:
    for node in NODES[:2]:
        await start_agent(node)
    driver = await start_runtime("installer", kv_buckets=BUCKETS)
    v1 = version_of(libraries.v1.read_bytes())
    assert await rollout.plan(driver, v1, None) == []
    assert await rollout.plan(driver, version_of(libraries.v2.read_bytes()), ["gpu-node-2"]) == ["gpu-node-2"]
    with pytest.raises(ConfigError, match="no node agent has reported"):
        await rollout.plan(driver, v1, ["gpu-node-9"])
    with pytest.raises(ConfigError, match="hex"):
        await rollout.run_rollout(driver, "latest")
    with pytest.raises(ConfigError, match="at least 1"):
        rollout.batches(NODES, 0)
    assert rollout.batches(NODES, 2) == [NODES[0:2], NODES[2:4], NODES[4:]]


async def test_planning_again_and_again_leaves_no_consumer_on_the_node_bucket(start_agent, start_runtime: RuntimeFactory, libraries: Libraries) -> None:
    for node in NODES[:2]:
        await start_agent(node)
    driver = await start_runtime("installer", kv_buckets=BUCKETS)
    for _ in range(5):  # every rollout plans from the node statuses
        assert sorted(await rollout.node_statuses(driver)) == NODES[:2]
    bucket = await driver.jetstream.stream_info(f"KV_{rollout.NODE_BUCKET}")
    assert bucket.state.consumer_count == 0


async def test_dry_run_prints_the_plan_and_changes_nothing(start_agent, bus_settings: BusSettings, libraries: Libraries) -> None:
    agents = [await start_agent(node) for node in NODES[:3]]
    v2 = version_of(libraries.v2.read_bytes())
    argv = [sys.executable, "-m", "kai_isolator.services.cli", "installer", "--nats-url", bus_settings.nats_url or "",
            "--version", v2, "--max-unavailable", "2", "--dry-run"]
    proc = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "batch 1: gpu-node-1, gpu-node-2" in proc.stdout and "batch 2: gpu-node-3" in proc.stdout
    assert all(install.active_version(a.layout) != v2 for a in agents)
    assert all(install_requests(a) == 0 for a in agents)
