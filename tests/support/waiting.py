"""Waiting for a condition: `eventually` in async tests (the check sync or async), `until` in sync ones (the real
node's, which block on kubectl). Both poll until the check answers something truthy and return that answer."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class _Patience:
    """A deadline, and what running out of it means: a failed test naming what was awaited, or (`fail=False`) the
    check's last answer handed back for the test to judge."""

    def __init__(self, what: str, timeout_s: float, fail: bool = True) -> None:
        self.what, self.timeout_s, self.fail = what, timeout_s, fail
        self.deadline = time.monotonic() + timeout_s

    def done(self, answer: object) -> bool:
        """Whether to stop asking: the answer holds, or time is up (then fails unless told not to)."""
        if answer or time.monotonic() <= self.deadline:
            return bool(answer)
        if self.fail:
            raise AssertionError(f"{self.what}: not so after {self.timeout_s:.0f}s")
        return True


def until(what: str, check: Callable[[], T], timeout_s: float = 60, every_s: float = 0.25) -> T:
    """Ask `check` every `every_s` until it answers something truthy; return that. Blocks: for sync tests."""
    patience = _Patience(what, timeout_s)
    while not patience.done(answer := check()):
        time.sleep(every_s)
    return answer


async def eventually(check: Callable[[], T | Awaitable[T]], timeout_s: float = 10.0, *, what: str = "the condition",
                     every_s: float = 0.02, fail: bool = True) -> T:
    """Ask `check` (a plain or an async callable) every `every_s` until it answers something truthy; return that.
    `fail=False`: on timeout, return the last (falsy) answer instead of failing the test."""
    patience = _Patience(what, timeout_s, fail)
    while not patience.done(answer := await _answer(check)):
        await asyncio.sleep(every_s)
    return answer


async def _answer(check: Callable[[], T | Awaitable[T]]) -> T:
    answer = check()
    return await answer if inspect.isawaitable(answer) else answer  # type: ignore[return-value]
