"""Ending a service's background loops for sure, on stop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task[None]], recancel_s: float = 1.0) -> None:
    """Cancel the tasks and wait until every one has ended, cancelling again each `recancel_s` while
    any runs on: a cancel that lands inside a NATS or HTTP call can come out as a timeout, which a loop
    that retries on timeouts carries on from (seen as a stop that hung for good)."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
