"""The watcher's record of each pod's story in KV: written ahead of its events, fenced by compare-and-set on the key's revision.

A record names the events it is about to publish (`pending`), so a crash in between republishes exactly
those. A closed story stays as a tombstone until no replay can reach back before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import sys
from collections.abc import Iterator

import nats.js.errors

from kai_isolator.shared.bus import WRONG_LAST_SEQUENCE, Runtime
from kai_isolator.shared.errors import LeaseLostError
from kai_isolator.shared.lease import Lease

from .acks import AckPipeline
from .settings import WatcherSettings
from .story import PodRecord

log = logging.getLogger(__name__)


class PodRecords:
    """This leader's copy of every tracked pod's record, and the KV revision each was last seen at (its fence)."""

    def __init__(self, runtime: Runtime, settings: WatcherSettings, lease: Lease) -> None:
        self.runtime = runtime
        self.settings = settings
        self.lease = lease
        self.acks: AckPipeline | None = None
        """The term's pipeline: record writes are pipelined like publishes."""
        self._by_uid: dict[str, PodRecord] = {}
        self._revisions: dict[str, int] = {}
        self._tombstones: list[tuple[int, str]] = []
        """(version, uid) of closed stories, a heap: dropped once the saved resume point passed them."""

    def __len__(self) -> int:
        return len(self._by_uid)

    def __iter__(self) -> Iterator[PodRecord]:
        return iter(list(self._by_uid.values()))

    def get(self, uid: str) -> PodRecord | None:
        return self._by_uid.get(uid)

    def uids(self) -> list[str]:
        return list(self._by_uid)

    def forget_all(self) -> None:
        """A new term starts from KV, as a fresh process would."""
        self._by_uid.clear()
        self._revisions.clear()
        self._tombstones.clear()

    def _key(self, uid: str) -> str:
        return f"{self.settings.scope}.{uid}"

    async def load(self) -> None:
        """Read every record of this scope back from KV."""
        watcher = await self.runtime.kv(self.settings.state_bucket).watch(f"{self.settings.scope}.>", ignore_deletes=True)
        try:
            while True:
                entry = await watcher.updates(timeout=self.runtime.settings.request_timeout_s)
                if entry is None:
                    break
                if entry.value:
                    record = slim(PodRecord.model_validate_json(entry.value))
                    self._by_uid[record.uid] = record
                    self._revisions[record.uid] = entry.revision or 0
                    if closed(record):
                        self.note_tombstone(record)
                if entry.delta == 0:
                    break
        finally:
            await watcher.stop()

    async def put(self, record: PodRecord) -> None:
        """Write a pod's record: a compare-and-set on the revision we know (create: on none)."""
        assert self.acks is not None
        await self.lease.wait_held()
        key = self._key(record.uid)
        value = record.model_dump_json().encode()
        last = self._revisions.get(record.uid)
        try:
            subject = f"$KV.{self.settings.state_bucket}.{key}"
            revision = (await self.acks.publish(subject, value, {"Nats-Expected-Last-Subject-Sequence": str(last or 0)})).seq
        except nats.js.errors.APIError as error:
            if error.err_code != WRONG_LAST_SEQUENCE:
                raise
            landed = await self._landed(key, value)  # sent again on a lost connection after the first had landed
            if landed is not None:
                revision = landed
            elif last is not None:
                raise LeaseLostError(f"pod record {key} was written by another watcher; resynchronising from KV") from None
            else:
                revision = await self._create_over_marker(key, value)
        self._revisions[record.uid] = revision
        self._by_uid[record.uid] = slim(record)

    async def _landed(self, key: str, value: bytes) -> int | None:
        """The revision of `key` when its latest value is exactly `value`: our own earlier copy of this write, stored."""
        try:
            entry = await self.runtime.kv(self.settings.state_bucket).get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.revision if entry.value == value else None

    async def _create_over_marker(self, key: str, value: bytes) -> int:
        """A create where the key was deleted before (a delete marker is its last entry): nats-py's create handles that."""
        try:
            return await self.runtime.kv(self.settings.state_bucket).create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise LeaseLostError(f"pod record {key} was written by another watcher; resynchronising from KV") from None

    async def drop(self, record: PodRecord) -> None:
        await self.lease.wait_held()
        key = self._key(record.uid)
        try:
            await self.runtime.kv(self.settings.state_bucket).delete(key, last=self._revisions.get(record.uid))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise LeaseLostError(f"pod record {key} was written by another watcher; resynchronising from KV") from None
        self._revisions.pop(record.uid, None)
        self._by_uid.pop(record.uid, None)

    def published(self, record: PodRecord) -> None:
        """The record's events are out: keep it in memory without them (KV still has them for a crash's recovery)."""
        if self._by_uid.get(record.uid) is record:
            record.pending = []  # ours alone: built by advance() for this change

    def note_tombstone(self, record: PodRecord) -> None:
        with contextlib.suppress(ValueError):
            heapq.heappush(self._tombstones, (int(record.resource_version), record.uid))

    async def drop_tombstones(self, saved: str) -> None:
        """No replay can start before the saved version any more: closed stories older than it can go."""
        try:
            limit = int(saved)
        except ValueError:
            return  # opaque versions: kept until a relist finds the pods gone
        due = []
        while self._tombstones and self._tombstones[0][0] <= limit:
            due.append(heapq.heappop(self._tombstones)[1])
        records = [self._by_uid[uid] for uid in due if uid in self._by_uid and closed(self._by_uid[uid])]
        for chunk in range(0, len(records), 256):
            await asyncio.gather(*(self.drop(r) for r in records[chunk:chunk + 256]))


_ALL_FIELDS = set(PodRecord.model_fields)
_REPEATED = ("namespace", "node_name", "phase", "container", "gpu_fraction", "gpu_memory", "expected_limit")


def slim(record: PodRecord) -> PodRecord:
    """A record as kept in memory for every tracked pod: a third smaller.

    pydantic keeps a set of the fields given per instance (0.7 KiB of a 2 KiB record), read only by
    exclude_unset dumps, which records never make: all share one. Values that most pods repeat
    (namespace, phase, container, ...) are interned instead of one copy per pod.
    """
    object.__setattr__(record, "__pydantic_fields_set__", _ALL_FIELDS)
    values = record.__dict__
    for name in _REPEATED:
        if values[name] is not None:
            values[name] = sys.intern(values[name])
    return record


def closed(record: PodRecord) -> bool:
    """A tombstone: the pod's `deleted` event is out; kept until no replay can reach back before it."""
    return "deleted" in record.emitted and not record.pending


def tombstone(record: PodRecord) -> PodRecord:
    deleted = [e for e in record.pending if e.state == "deleted"]
    version = deleted[-1].resource_version if deleted else record.resource_version
    return record.model_copy(update={"pending": [], "emitted": [*record.emitted, "deleted"], "resource_version": version})
