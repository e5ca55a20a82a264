"""Verifications in flight in this replica: one at a time per pod.

An event, a library version change and the periodic pass can each ask for the same pod at once.
Two looks judged side by side would both inspect, both emit (the bus and Kubernetes absorb the
repeat, but not the warnings of a second look landing after the pod was deleted), and the older
look could record its verdict last. So each pod is claimed for the whole verification, and for
forgetting it: an event or a version change waits its turn (it may carry news), the pass does not
wait (the pod is being looked at already; it comes round again next pass).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class InFlight:
    """Per-pod claims, keyed by the pod's uid; a claim nobody holds or waits for takes no memory."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}  # holders and waiters per uid, to drop the lock with the last one

    def busy(self, uid: str) -> bool:
        lock = self._locks.get(uid)
        return lock is not None and lock.locked()

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def claim(self, uid: str, *, wait: bool = True) -> AsyncIterator[bool]:
        """Hold `uid` for the block (True); without `wait`, yield False at once, holding nothing, when it is held."""
        if not wait and self.busy(uid):
            yield False
            return
        lock = self._locks.setdefault(uid, asyncio.Lock())
        self._users[uid] = self._users.get(uid, 0) + 1
        try:
            async with lock:
                yield True
        finally:
            self._users[uid] -= 1
            if not self._users[uid]:
                del self._users[uid], self._locks[uid]
