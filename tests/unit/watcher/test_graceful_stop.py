"""The watcher's graceful stop is bounded: one that does not end in time is ended as by a crash."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kai_isolator.services.watcher import command


async def test_a_stop_that_hangs_is_ended_after_the_bound(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(command, "GRACEFUL_STOP_S", 0.2)
    hanging = asyncio.create_task(asyncio.sleep(3600))
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(command.stopped(hanging), 5)
    assert hanging.cancelled()
    assert "graceful stop did not end in time" in caplog.text


async def test_a_stop_that_ends_keeps_its_error() -> None:
    async def buggy() -> None:
        raise RuntimeError("a bug in the watcher")

    with pytest.raises(RuntimeError, match="a bug in the watcher"):
        await command.stopped(asyncio.create_task(buggy()))


async def test_cancelling_the_wait_ends_the_watcher_too() -> None:
    hanging = asyncio.create_task(asyncio.sleep(3600))
    waiting = asyncio.create_task(command.stopped(hanging))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert hanging.cancelled()
