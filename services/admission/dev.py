"""The webhook as a `kai-isolator dev` component: a throw-away CA, HTTPS on a free loopback port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .certs import issue
from .server import AdmissionServer
from .settings import AdmissionSettings

if TYPE_CHECKING:
    from kai_isolator.services.dev import DevContext


@contextlib.asynccontextmanager
async def component(ctx: DevContext) -> AsyncIterator[None]:
    """Serve /mutate and publish its webhook URL and CA bundle for whoever registers it."""
    pair = issue(["localhost", "127.0.0.1"])
    ca, cert, key = pair.write(ctx.workdir / "admission")
    overrides = {k: ctx.values[k] for k in ("container_vgpu_mount", "state_dir", "grant_dir", "policy", "require_nri_plugin") if k in ctx.values}
    settings = AdmissionSettings(listen="127.0.0.1:0", tls_cert_file=cert, tls_private_key_file=key, **overrides)
    server = AdmissionServer(settings, ctx.bus)
    await server.start()
    ctx.values["admission_url"] = f"{server.url}/mutate"
    ctx.values["admission_ca_bundle"] = pair.ca_pem
    ctx.values["admission_ca_file"] = ca
    try:
        yield
    finally:
        await server.stop()
