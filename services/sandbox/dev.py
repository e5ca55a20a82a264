"""The sandbox as a `kai-isolator dev` component (a test/demo fixture): API, simulated GPU node, kubeconfig.

Publishes `ctx.values["kubeconfig"]` (and `sandbox_api`). When the admission component
publishes `admission_url` + `admission_ca_bundle`, registers its webhook in the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .api import SandboxApi
from .settings import SandboxSettings

if TYPE_CHECKING:
    from kai_isolator.services.dev import DevContext

log = logging.getLogger(__name__)

WEBHOOK_NAME = "kai-resource-isolator"
# The pods the isolator cares about, as a matchCondition, and the namespace opt-out.
GPU_SHARING_CONDITION = {
    "name": "gpu-sharing-pods",
    "expression": "has(object.metadata.annotations) && ('gpu-fraction' in object.metadata.annotations || 'gpu-memory' in object.metadata.annotations)",
}
NAMESPACE_OPT_OUT = {"matchExpressions": [{"key": "kai-resource-isolator.io/webhook", "operator": "NotIn", "values": ["ignore"]}]}


async def register_admission_when_ready(api: SandboxApi, values: dict[str, Any], poll_s: float = 0.05) -> None:
    """Wait for the admission component's URL and CA (it starts after the sandbox), then register it."""
    while "admission_url" not in values or "admission_ca_bundle" not in values:
        await asyncio.sleep(poll_s)
    await api.register_webhook(
        WEBHOOK_NAME, values["admission_url"], values["admission_ca_bundle"], failure_policy="Ignore", timeout_s=5,
        namespace_selector=NAMESPACE_OPT_OUT, match_conditions=[GPU_SHARING_CONDITION],
    )
    log.info("admission webhook registered in the sandbox", extra={"url": values["admission_url"]})


@contextlib.asynccontextmanager
async def component(ctx: DevContext) -> AsyncIterator[None]:
    settings = SandboxSettings(kubeconfig=ctx.workdir / "sandbox" / "kubeconfig", bookmark_interval_s=5.0)
    async with SandboxApi(settings) as api:
        ctx.values["kubeconfig"] = settings.kubeconfig
        ctx.values["sandbox_api"] = api
        print(f"sandbox API (test/demo fixture) at {api.url}; KUBECONFIG={settings.kubeconfig}", flush=True)
        registrar = asyncio.create_task(register_admission_when_ready(api, ctx.values))
        try:
            yield
        finally:
            registrar.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await registrar
