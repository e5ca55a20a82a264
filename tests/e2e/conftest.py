"""The whole isolation chain in one process: the local control plane (real kube-apiserver), webhook, watcher, verifier, a node agent the
test can stop and start, and the demo kubelet running containers as real processes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from kai_isolator.services.admission import dev as admission_dev
from kai_isolator.services.demo.scenario import HAMI_BUILD, BusLog, Demo, kubernetes
from kai_isolator.services.dev import DevContext
from kai_isolator.services.nodeagent.agent import NodeAgent
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.services.devcluster import dev as devcluster_dev
from kai_isolator.services.verifier import dev as verifier_dev
from kai_isolator.services.watcher import dev as watcher_dev
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.settings import BusSettings

NODE = "gpu-node-1"


@dataclass
class Chain:
    ctx: DevContext
    demo: Demo
    bus: BusLog
    agent_settings: NodeAgentSettings
    agent: NodeAgent | None = None

    async def start_agent(self) -> None:
        self.agent = NodeAgent(self.agent_settings, self.ctx.bus)
        await self.agent.start(self.ctx.nats_url)

    async def stop_agent(self) -> None:
        if self.agent is not None:
            await self.agent.stop()
            self.agent = None


@pytest.fixture
async def chain(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[Chain]:
    bus = BusSettings(nats_url=nats_server.url, max_deliver=20, backoff_base_s=0.1, backoff_max_s=1.0)
    ctx = DevContext(nats_url=nats_server.url, bus=bus, workdir=tmp_path)
    host_root = tmp_path / "host"
    host_root.mkdir()
    ctx.values.update(host_root=host_root, node_name=NODE)
    async with contextlib.AsyncExitStack() as stack:
        for component in (admission_dev.component, devcluster_dev.component, watcher_dev.component, verifier_dev.component):
            await stack.enter_async_context(component(ctx))
        agent_settings = NodeAgentSettings(node_name=NODE, host_root=host_root, library=[HAMI_BUILD / "libvgpu.so"], status_interval_s=60,
                                           usage_interval_s=60, kubeconfig=ctx.values["kubeconfig"])
        api: client.ApiClient = await stack.enter_async_context(kubernetes(Path(ctx.values["kubeconfig"])))
        events = await stack.enter_async_context(BusLog(nats_server.url))
        demo = Demo(ctx, api, events)
        chain = Chain(ctx, demo, events, agent_settings)
        await chain.start_agent()
        try:
            yield chain
        finally:
            await demo.stop()
            await chain.stop_agent()
