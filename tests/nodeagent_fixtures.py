"""Fixtures for node agent and installer tests: two library builds and agents on temp host roots."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from kai_isolator.services.demo.kubelet import CgroupPlacement, cgroup_hierarchies
from kai_isolator.services.nodeagent.agent import NodeAgent
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.shared.settings import BusSettings
from nodeagent_harness import HAMI, Libraries, make_libraries

AgentFactory = Callable[..., Awaitable[NodeAgent]]


@pytest.fixture(scope="session")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> Libraries:
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return make_libraries(tmp_path_factory.mktemp("libraries"))


@pytest.fixture
async def start_agent(bus_settings: BusSettings, tmp_path: Path, libraries: Libraries) -> AsyncIterator[AgentFactory]:
    """Start agents named `node` on their own temp host roots (long periods: tests drive refreshes)."""
    started: list[NodeAgent] = []

    async def factory(node: str, **overrides: object) -> NodeAgent:
        root = tmp_path / f"host-{node}"
        root.mkdir(exist_ok=True)
        fields = {"node_name": node, "host_root": root, "library": [libraries.v1, libraries.v2], "gc_grace_s": 0,
                  "status_interval_s": 3600, "usage_interval_s": 3600, **overrides}
        agent = NodeAgent(NodeAgentSettings(**fields), bus_settings, probe_listen="127.0.0.1:0")
        await agent.start(bus_settings.nats_url or "")
        started.append(agent)
        return agent

    yield factory
    for agent in reversed(started):
        await agent.stop()


@pytest.fixture
def kubelet_cgroups() -> Iterator[CgroupPlacement]:
    """Kubelet-named cgroups under a prefix unique to this test (the agent finds containers by them)."""
    if os.geteuid() != 0 or not cgroup_hierarchies():
        pytest.skip("placing processes in kubelet-named cgroups needs root and a writable cgroup hierarchy")
    placement = CgroupPlacement()
    yield placement
    placement.remove()
