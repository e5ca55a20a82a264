"""`kai-isolator dev` component: a node agent on a temp host root, installing hami-core's build."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from kai_isolator.services.devcluster.fake_gpu_ledger import FAKE_CONTEXT_OVERHEAD_BYTES, FakeGpu, FakeGpuError

from .agent import NodeAgent
from .settings import NodeAgentSettings

if TYPE_CHECKING:  # services.dev imports this module
    from kai_isolator.services.dev import DevContext

log = logging.getLogger(__name__)
LIBRARY = Path(__file__).resolve().parents[2] / "hami-core" / "build" / "libvgpu.so"


@contextlib.asynccontextmanager
async def component(ctx: DevContext) -> AsyncIterator[None]:
    node = str(ctx.values.get("node_name") or "gpu-node-1")
    root = ctx.workdir / f"host-{node}"
    root.mkdir(parents=True, exist_ok=True)
    libraries = [LIBRARY] if LIBRARY.is_file() else []
    if not libraries:
        log.warning("hami-core/build/libvgpu.so missing (run make -C hami-core); the agent starts with nothing to install")
    # The local control plane (started earlier) is this agent's API server: it writes grants for the pods bound to it.
    # One fake GPU for every demo container: its ledger process beside a copy of the fake driver, which the
    # containers load (fake_driver_env) and the agent's enforcer reads through the fake NVML there.
    gpu = FakeGpu(ctx.workdir / "nvidia-driver")
    try:
        gpu.start()
        ctx.values["fake_driver_env"] = {"LD_LIBRARY_PATH": str(gpu.folder)}
    except FakeGpuError as error:
        log.warning("no fake GPU on this node (%s): the agent's enforcer has no driver view", error)
    settings = NodeAgentSettings(node_name=node, host_root=root, library=libraries, status_interval_s=15, usage_interval_s=5,
                                 kubeconfig=ctx.values.get("kubeconfig"), nvml_library=str(gpu.nvml),
                                 # one demo process per container: the fake driver's overhead for its one context
                                 breach_tolerance_mib=-(-FAKE_CONTEXT_OVERHEAD_BYTES // (1 << 20)))
    agent = NodeAgent(settings, ctx.bus, probe_listen="127.0.0.1:0")
    try:
        await agent.start(ctx.nats_url)
    except BaseException:
        gpu.stop()
        raise
    ctx.values.update(node_name=node, host_root=root, nodeagent_metrics=f"{agent.runtime.probe_url}/metrics")
    ctx.values["grant_root"] = agent.grant_root
    print(f"node agent {node}: host root {root}, grants in {agent.grant_root}, metrics {agent.runtime.probe_url}/metrics", flush=True)
    try:
        yield
    finally:
        await agent.stop()
        gpu.stop()
