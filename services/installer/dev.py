"""`kai-isolator dev` component: the rollout driver is a one-shot command, so in dev it only
shows the rollout plan of the node agents' active version and how to run one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kai_isolator.shared.bus import Runtime

from . import rollout

if TYPE_CHECKING:  # services.dev imports this module
    from kai_isolator.services.dev import DevContext


@contextlib.asynccontextmanager
async def component(ctx: DevContext) -> AsyncIterator[None]:
    runtime = Runtime("installer", ctx.bus, kv_buckets=[rollout.NODE_BUCKET, rollout.ROLLOUT_BUCKET])
    await runtime.start(ctx.nats_url)
    try:
        statuses = await rollout.node_statuses(runtime)
    finally:
        await runtime.stop()
    for node, status in sorted(statuses.items()):
        print(f"installer: {node} runs {status.active_version or 'nothing'} (self-check {status.self_check}); "
              f"roll out with: kai-isolator installer --nats-url {ctx.nats_url} --version <version>", flush=True)
    yield
