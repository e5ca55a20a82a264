"""Small helpers the tests share."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError
from kai_isolator.shared.events import Payload

RuntimeFactory = Callable[..., Awaitable[Runtime]]
Built = TypeVar("Built")


def build_before_tests(config: pytest.Config, items: list[pytest.Item], fixtures: set[str], build: Callable[[], Built],
                       failure: type[Exception]) -> Built | Exception | None:
    """Build what tests using `fixtures` need once, before any runs: outside every test's timeout, progress on the terminal.

    A build failure is returned, not raised: the tests that need it fail with it, the rest of the suite still runs.
    """
    if not any(fixtures & set(getattr(item, "fixturenames", ())) for item in items):
        return None
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        try:
            return build()
        except failure as error:
            return error


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
