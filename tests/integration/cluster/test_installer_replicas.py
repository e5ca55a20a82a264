"""Two installers on a three-node cluster: one rollout at a time (the KV lease); the holder SIGKILLed
mid-rollout, the other takes over and resumes from KV without redoing finished nodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import Any

import pytest

from kai_isolator.services.installer import rollout
from kai_isolator.services.nodeagent import install
from kai_isolator.services.nodeagent.layout import version_of
from kai_isolator.shared import subjects
from kai_isolator.shared.settings import BusSettings
from support.bus import RuntimeFactory
from support.nodeagent import Libraries

NODES = [f"gpu-node-{i}" for i in range(1, 5)]


def install_requests(agent) -> float:  # type: ignore[no-untyped-def]
    value = agent.runtime.metrics.registry.get_sample_value(
        "kai_isolator_bus_messages_total", {"handler": subjects.node_install(agent.node), "outcome": "ok"})
    return value or 0.0


async def logged(process: asyncio.subprocess.Process, message: str) -> dict[str, Any]:
    """The first JSON log line on `process`'s stderr whose msg is `message`; fails if the process exits first."""
    assert process.stderr is not None
    seen: list[str] = []
    while raw := await process.stderr.readline():
        line = raw.decode().strip()
        seen.append(line)
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("msg") == message:
                return record
    raise AssertionError(f"exited ({await process.wait()}) before logging {message!r}: {seen}")


@pytest.mark.timeout(240)
async def test_second_installer_waits_then_resumes_the_killed_holders_rollout(
        start_agent, start_runtime: RuntimeFactory, libraries: Libraries, bus_settings: BusSettings) -> None:  # type: ignore[no-untyped-def]
    # The later nodes' self-checks take seconds, so the first installer is surely mid-rollout when killed.
    slow = ["/bin/sh", "-c", "sleep 3"]
    agents = {node: await start_agent(node, self_check_command=slow if node in NODES[2:] else None) for node in NODES}
    v2 = version_of(libraries.v2.read_bytes())
    observer = await start_runtime("observer", kv_buckets=[rollout.NODE_BUCKET, rollout.ROLLOUT_BUCKET])
    # The installer plans the nodes whose agents have reported. An agent's first report can fail on a loaded
    # cluster (it logs it and reports on its next tick, an hour away here), and a node missing from KV is not planned.
    for _ in range(20):
        missing = [n for n in NODES if n not in await rollout.node_statuses(observer)]
        if not missing:
            break
        await asyncio.gather(*(agents[n].refresh() for n in missing))
    assert not missing, f"no status in KV for {missing}"
    env = {**os.environ, "KAI_ISOLATOR_NATS_URL": bus_settings.nats_url or "", "KAI_ISOLATOR_NATS_REPLICAS": "3",
           "KAI_ISOLATOR_NATS_PING_INTERVAL_S": "1", "KAI_ISOLATOR_LOG_LEVEL": "warning"}
    command = [sys.executable, "-m", "kai_isolator.services.cli", "installer", "--version", v2, "--lease-ttl-s", "2", "--node-timeout-s", "30"]
    first = await asyncio.create_subprocess_exec(*command, env=env, stdout=asyncio.subprocess.DEVNULL)
    progress: list[str] = []

    async def done_so_far() -> list[str]:
        state = await rollout.load_state(observer, rollout.default_rollout_id(v2))
        return state.done if state else []

    async def poll() -> bool:
        progress[:] = await done_so_far()
        return len(progress) >= 1

    for _ in range(600):
        if await poll():
            break
        await asyncio.sleep(0.05)
    # The second logs at info, as JSON, so that its "standing by" line (shared/lease.py) proves it waits on the lease.
    told = {**env, "KAI_ISOLATOR_LOG_LEVEL": "info", "KAI_ISOLATOR_LOG_JSON": "true"}
    second = await asyncio.create_subprocess_exec(*command, env=told, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    standing_by = await asyncio.wait_for(logged(second, "standing by: lease held by another replica"), 60)
    # Waiting on the first installer's lease, not driving a second rollout beside it (holder: installer@host:pid:suffix).
    assert standing_by["lease"] == rollout.LEASE_KEY and f":{first.pid}:" in standing_by["holder"], standing_by
    assert first.returncode is None
    first.kill()  # SIGKILL the holder mid-rollout
    await first.wait()
    done_by_first = list(await done_so_far())
    assert 1 <= len(done_by_first) < len(NODES)

    out, err = await asyncio.wait_for(second.communicate(), 120)
    assert second.returncode == 0, (out, err)
    state = await rollout.load_state(observer, rollout.default_rollout_id(v2))
    assert state is not None and state.phase == "completed" and sorted(state.done) == NODES
    assert [install.active_version(agents[n].layout) for n in NODES] == [v2] * len(NODES)
    assert all(install_requests(agents[n]) == 1 for n in done_by_first)  # finished nodes were not redone
