"""The local control plane as a `kai-isolator dev` component: real kube-apiserver, simulated KAI and GPU node, a kubeconfig.

Publishes `ctx.values["kubeconfig"]` and `dev_cluster`. When the admission component publishes `admission_url` +
`admission_ca_bundle`, registers our webhook with the real API server, as deploy/ does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .cluster import DevCluster

if TYPE_CHECKING:
    from kai_isolator.services.dev import DevContext

log = logging.getLogger(__name__)


async def register_admission_when_ready(cluster: DevCluster, values: dict[str, Any], poll_s: float = 0.05) -> None:
    """Wait for the admission component's URL and CA (it may start after the cluster), then register it."""
    while "admission_url" not in values or "admission_ca_bundle" not in values:
        await asyncio.sleep(poll_s)
    await cluster.register_webhook(values["admission_url"], values["admission_ca_bundle"])
    values["webhook_registered"] = True
    log.info("admission webhook registered with kube-apiserver", extra={"url": values["admission_url"]})


@contextlib.asynccontextmanager
async def component(ctx: DevContext) -> AsyncIterator[None]:
    async with DevCluster(workdir=ctx.workdir / "devcluster") as cluster:
        ctx.values["kubeconfig"] = cluster.kubeconfig
        ctx.values["dev_cluster"] = cluster
        times = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in cluster.startup_s.items())
        print(f"local control plane (real kube-apiserver + etcd; KAI-Scheduler and the kubelet simulated) at {cluster.url} "
              f"in {times}; KUBECONFIG={cluster.kubeconfig}", flush=True)
        registrar = asyncio.create_task(register_admission_when_ready(cluster, ctx.values))
        try:
            yield
        finally:
            registrar.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await registrar
