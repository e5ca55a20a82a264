"""`kai-isolator dev` component: a node agent on a temp host root, installing hami-core's build."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from .agent import NodeAgent
from .settings import NodeAgentSettings

if TYPE_CHECKING:  # services.dev imports this module
    from kai_isolator.services.dev import DevContext

log = logging.getLogger(__name__)
LIBRARY = Path(__file__).resolve().parents[2] / "hami-core" / "build" / "libvgpu.so"
FAKE_NVML = LIBRARY.parent / "fake" / "libnvidia-ml.so.1"


@contextlib.asynccontextmanager
async def component(ctx: DevContext) -> AsyncIterator[None]:
    node = str(ctx.values.get("node_name") or "gpu-node-1")
    root = ctx.workdir / f"host-{node}"
    root.mkdir(parents=True, exist_ok=True)
    libraries = [LIBRARY] if LIBRARY.is_file() else []
    if not libraries:
        log.warning("hami-core/build/libvgpu.so missing (run make -C hami-core); the agent starts with nothing to install")
    # The local control plane (started earlier) is this agent's API server: it writes grants for the pods bound to it.
    # One node-wide fake-driver ledger for every demo container; the agent's enforcer reads it through the
    # fake NVML loaded in this process (the real NVML needs neither).
    ledger = ctx.workdir / "fake-driver.ledger"
    os.environ["FAKE_CUDA_STATE"] = str(ledger)
    ctx.values["fake_driver_env"] = {"FAKE_CUDA_STATE": str(ledger)}
    settings = NodeAgentSettings(node_name=node, host_root=root, library=libraries, status_interval_s=15, usage_interval_s=5,
                                 kubeconfig=ctx.values.get("kubeconfig"), nvml_library=str(FAKE_NVML),
                                 breach_tolerance_mib=0)  # the fake driver reserves nothing per context
    agent = NodeAgent(settings, ctx.bus, probe_listen="127.0.0.1:0")
    await agent.start(ctx.nats_url)
    ctx.values.update(node_name=node, host_root=root, nodeagent_metrics=f"{agent.runtime.probe_url}/metrics")
    ctx.values["grant_root"] = agent.grant_root
    print(f"node agent {node}: host root {root}, grants in {agent.grant_root}, metrics {agent.runtime.probe_url}/metrics", flush=True)
    try:
        yield
    finally:
        await agent.stop()
