"""A lease held in a NATS KV key: one holder at a time among replicas, taken over when the holder stops renewing.

Fencing: the holder acts only while `held()` (its own monotonic deadline, which ends before any
contender may take over) and every renewal is a compare-and-set on the KV revision, so a
holder that was paused past its term finds out on its next check instead of acting on.
A term that runs out while NATS is unreachable is not lost: the holder stops acting and renews
once NATS answers, and goes on only if nobody else wrote the key meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue
from pydantic import BaseModel

from .errors import BusError, LeaseLostError

log = logging.getLogger(__name__)

LEASE_BUCKET = "isolator_leases"
"""The KV bucket of every lease (key = what is leased, e.g. `watcher.all`, `installer.rollout`)."""

_BUS_FAILURES = (nats.errors.Error, asyncio.TimeoutError, BusError)


class LeaseRecord(BaseModel):
    """The lease key's value: who holds it and for how long a silence means it is free."""

    holder: str
    ttl_s: float


def holder_name(service: str) -> str:
    """Unique per process: host (the pod name in Kubernetes), pid and a random suffix."""
    return f"{service}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Lease:
    """One replica's view of a lease key; `acquire()`, then `keep()` in a task while working."""

    def __init__(self, kv: KeyValue, key: str, holder: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("a lease needs a positive ttl")
        self.kv = kv
        self.key = key
        self.holder = holder
        self.ttl_s = ttl_s
        self.token: int | None = None
        """The KV revision of our last write: the fencing token, None when not held."""
        self._deadline = 0.0
        self.lost = asyncio.Event()
        self._changed = asyncio.Event()
        """Set when a term is granted or the lease is lost: wakes `wait_held`."""
        self.holder_seen: str | None = None
        """The holder a waiting replica last saw (for logs and status)."""

    def held(self) -> bool:
        """True while this replica may act: it holds the lease and its term has not run out."""
        return self.token is not None and time.monotonic() < self._deadline

    def check(self) -> None:
        """LeaseLostError unless `held()`; call before each step that must not be done twice."""
        if not self.held():
            self._lose(keep_token=True)
            raise LeaseLostError(f"lease {self.key} no longer held by {self.holder}")

    async def wait_held(self) -> None:
        """Return while `held()`; after a term that ran out with NATS unreachable, once `keep()` has renewed it
        (nothing may act meanwhile: another replica may have taken over); LeaseLostError once it is lost."""
        while not self.held():
            if self.token is None or self.lost.is_set():
                self._lose(keep_token=True)
                raise LeaseLostError(f"lease {self.key} no longer held by {self.holder}")
            self._changed.clear()
            await self._changed.wait()

    def _lose(self, keep_token: bool = False) -> None:
        if not keep_token:
            self.token = None
        self.lost.set()
        self._changed.set()

    def _value(self) -> bytes:
        return LeaseRecord(holder=self.holder, ttl_s=self.ttl_s).model_dump_json().encode()

    def _granted(self, revision: int, sent_at: float) -> None:
        # The term runs from before the write was sent: a contender's clock starts after it saw the write.
        self.token = revision
        self._deadline = sent_at + self.ttl_s * 0.8
        self.lost.clear()
        self._changed.set()

    async def try_acquire(self, observed: dict[str, tuple[int, float]] | None = None) -> bool:
        """One attempt: create the key, or take it over once its revision stood still for a whole ttl.

        `observed` carries, between attempts, the revision seen and when it was first seen.
        """
        observed = {} if observed is None else observed
        sent_at = time.monotonic()
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            entry = None
        if entry is None or not entry.value:
            try:
                self._granted(await self.kv.create(self.key, self._value()), sent_at)
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                return False  # another replica created it first
        record = _record(entry.value)
        revision = entry.revision or 0
        self.holder_seen = record.holder if record else None
        if record is not None and record.holder == self.holder:
            return await self._write(revision, sent_at)  # our own, e.g. after a resync
        seen = observed.get(self.key)
        if seen is None or seen[0] != revision:
            observed[self.key] = (revision, time.monotonic())
            return False
        ttl = record.ttl_s if record else self.ttl_s
        if time.monotonic() - seen[1] < ttl:
            return False
        log.warning("lease holder went silent; taking over", extra={"lease": self.key, "from": self.holder_seen, "to": self.holder})
        return await self._write(revision, sent_at)

    async def _write(self, revision: int, sent_at: float) -> bool:
        try:
            self._granted(await self.kv.update(self.key, self._value(), last=revision), sent_at)
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            return False

    async def acquire(self, stopping: asyncio.Event | None = None) -> bool:
        """Wait until held (True) or `stopping` is set (False); bus failures are waited out."""
        observed: dict[str, tuple[int, float]] = {}
        self.holder_seen = None
        waiting_logged = False
        while stopping is None or not stopping.is_set():
            try:
                if await self.try_acquire(observed):
                    log.info("lease acquired", extra={"lease": self.key, "holder": self.holder, "token": self.token})
                    return True
            except _BUS_FAILURES as error:
                log.debug("lease attempt failed", extra={"lease": self.key, "error": repr(error)})
            # Only a rival is named as one: our own earlier term, or no answer from NATS, is not a rival.
            if not waiting_logged and self.holder_seen not in (None, self.holder):
                log.info("standing by: lease held by another replica", extra={"lease": self.key, "holder": self.holder_seen})
                waiting_logged = True
            await _sleep_unless(stopping, self.ttl_s / 4)
        return False

    async def renew(self) -> None:
        """Extend the term (compare-and-set on our token); LeaseLostError when another holds it now."""
        if self.token is None:
            raise LeaseLostError(f"lease {self.key} is not held")
        sent_at = time.monotonic()
        try:
            revision = await self.kv.update(self.key, self._value(), last=self.token)
        except nats.js.errors.KeyWrongLastSequenceError:
            revision = await self._renew_over_own_write()
        self._granted(revision, sent_at)

    async def _renew_over_own_write(self) -> int:
        """The key moved past our token. A renewal that timed out on our side can still land later (nats-py
        sends what it buffered while reconnecting): when the key holds our own value, every write since our
        token was ours (a rival's write would name it and fence out our later ones), so renew on top of it."""
        try:
            entry = await self.kv.get(self.key)
            record = _record(entry.value or b"")
            if record is None or record.holder != self.holder:
                raise LeaseLostError(f"lease {self.key} was taken over by {record.holder if record else 'another replica'}")
            return await self.kv.update(self.key, self._value(), last=entry.revision)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyWrongLastSequenceError):
            raise LeaseLostError(f"lease {self.key} was taken over") from None
        except LeaseLostError:
            self._lose()
            raise

    async def keep(self) -> None:
        """Renew every third of the ttl until lost. A renewal NATS does not answer is tried again soon; past the
        term's end nothing acts (`held()` is False) and renewing goes on, so one replica cut off from NATS for
        longer than its term keeps its lease when nobody took it over meanwhile, instead of giving it up to nobody."""
        lapsed = failing = False
        while not self.lost.is_set():
            await asyncio.sleep(min(0.5, self.ttl_s / 10) if failing else self.ttl_s / 3)
            try:
                await self.renew()
            except LeaseLostError:
                self._lose()
                log.warning("lease lost", extra={"lease": self.key, "holder": self.holder})
                return
            except _BUS_FAILURES as error:
                failing = True
                if not self.held() and not lapsed:
                    lapsed = True
                    log.warning("lease term ran out while NATS was unreachable; renewing once it answers",
                                extra={"lease": self.key, "error": repr(error)})
                continue
            except Exception:
                self._lose()  # whoever waits in wait_held() must not wait for a keeper that is gone
                raise
            if lapsed:
                log.info("lease renewed after NATS returned: nobody took it over", extra={"lease": self.key, "holder": self.holder})
            lapsed = failing = False

    async def release(self) -> None:
        """Give the lease up at once (graceful stop), so a standby need not wait out the ttl."""
        token, self.token = self.token, None
        if token is None:
            return
        with contextlib.suppress(*_BUS_FAILURES, nats.js.errors.KeyWrongLastSequenceError):
            await self.kv.delete(self.key, last=token)
            log.info("lease released", extra={"lease": self.key, "holder": self.holder})


def _record(value: bytes) -> LeaseRecord | None:
    try:
        return LeaseRecord.model_validate_json(value)
    except ValueError:
        return None  # unreadable: treated as held by someone unknown, taken over after a silent ttl


async def _sleep_unless(stopping: asyncio.Event | None, seconds: float) -> None:
    if stopping is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)
