"""The verifier's `kai-isolator dev` component: verdicts for the local control plane's pods, Events into its API."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .command import running
from .settings import VerifierSettings

if TYPE_CHECKING:
    from kai_isolator.services.dev import DevContext


@contextlib.asynccontextmanager
async def component(ctx: DevContext) -> AsyncIterator[None]:
    kubeconfig = ctx.values.get("kubeconfig")
    settings = VerifierSettings(kubeconfig=kubeconfig, kubernetes_events=kubeconfig is not None, reverify_s=30, pending_retry_s=1)
    async with running(settings, ctx.bus, ctx.nats_url) as verifier:
        ctx.values["verifier"] = verifier
        yield
