"""Ordered lanes and the resume point: many pods handled side by side, one pod's changes strictly in order.

The resume point advances only past changes every one of which (and all before it) is fully handled.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

Action = Callable[..., Awaitable[None]]


class Change:
    """One change read from the API (or a relist item): handled once its lane ran it."""

    __slots__ = ("version", "done")

    def __init__(self, version: str | None, done: bool = False) -> None:
        self.version = version
        self.done = done


class Progress:
    """Changes in the order they were read; `handled` is the version of the last change with none unhandled before it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.handled: str | None = None
        self.advanced = 0
        """Changes passed since the counter was last reset (the resume save's trigger)."""
        self._changes: deque[Change] = deque()
        self._room = asyncio.Event()
        self._room.set()
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._changes)

    def enter(self, version: str | None, done: bool = False) -> Change:
        change = Change(version, done)
        self._changes.append(change)
        self._empty.clear()
        if len(self._changes) >= self.limit:
            self._room.clear()
        if done:
            self._advance()
        return change

    def finish(self, change: Change) -> None:
        change.done = True
        if self._changes and self._changes[0] is change:
            self._advance()

    def _advance(self) -> None:
        changes = self._changes
        while changes and changes[0].done:
            version = changes.popleft().version
            if version is not None:
                self.handled = version
            self.advanced += 1
        if len(changes) < self.limit:
            self._room.set()
        if not changes:
            self._empty.set()

    async def room(self) -> None:
        await self._room.wait()

    async def drained(self) -> None:
        await self._empty.wait()

    def reset(self) -> None:
        self._changes.clear()
        self.handled, self.advanced = None, 0
        self._room.set()
        self._empty.set()


class Lanes:
    """`count` worker tasks; work for one key always goes to the same lane and runs there in order.

    A failing action ends the lane's task with its exception; `run()` (in a TaskGroup) raises it, which
    ends the whole term: nothing after the failed change of that pod may run out of order.
    """

    def __init__(self, count: int, progress: Progress) -> None:
        self.progress = progress
        self._queues: list[asyncio.Queue[tuple[Change, Action, tuple[Any, ...]]]] = [asyncio.Queue() for _ in range(count)]

    def lane_of(self, key: str) -> int:
        # Stable across the process (str hash is too, but crc32 keeps tests reproducible).
        return zlib.crc32(key.encode()) % len(self._queues)

    def submit(self, key: str, version: str | None, action: Action, *args: Any) -> Change:
        change = self.progress.enter(version)
        self._queues[self.lane_of(key)].put_nowait((change, action, args))
        return change

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            for index, queue in enumerate(self._queues):
                group.create_task(self._lane(queue), name=f"watch-lane-{index}")

    async def _lane(self, queue: asyncio.Queue[tuple[Change, Action, tuple[Any, ...]]]) -> None:
        while True:
            change, action, args = await queue.get()
            await action(*args)
            self.progress.finish(change)
