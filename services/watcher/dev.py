"""The watcher's `kai-isolator dev` component: watches the local control plane (or any kubeconfig) and publishes pod events."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kai_isolator.shared.errors import ConfigError

from .command import running
from .settings import WatcherSettings

if TYPE_CHECKING:
    from kai_isolator.services.dev import DevContext


@contextlib.asynccontextmanager
async def component(ctx: DevContext) -> AsyncIterator[None]:
    kubeconfig = ctx.values.get("kubeconfig")
    if not kubeconfig:
        raise ConfigError("the watcher's dev component needs a kubeconfig: start the devcluster component first")
    settings = WatcherSettings(kubeconfig=kubeconfig)
    async with running(settings, ctx.bus, ctx.nats_url):
        yield
