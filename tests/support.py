"""Small helpers the tests share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError
from kai_isolator.shared.events import Payload

RuntimeFactory = Callable[..., Awaitable[Runtime]]


async def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until `predicate()` holds; fail the test if it does not within the timeout."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def publish_until_stored(runtime: Runtime, event: Payload) -> None:
    """At-least-once publishing through an outage; the Nats-Msg-Id makes a retry harmless."""
    while True:
        try:
            await runtime.publish(event)
            return
        except BusError:
            await asyncio.sleep(0.1)
