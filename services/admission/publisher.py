"""Decisions to the bus off the response path: a bounded buffer, publishes pipelined with a window of
unacknowledged ones, each retried under its Nats-Msg-Id until the stream stores it or its time is up."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections import Counter as Tally
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone

import nats.errors
import orjson
from nats.aio.msg import Msg
from prometheus_client import Counter

from kai_isolator.shared import frames, subjects
from kai_isolator.shared.bus import DUPLICATE_IN_PROCESS, HEADERS_CONTENT_TYPE, Runtime
from kai_isolator.shared.errors import DecodeError
from kai_isolator.shared.events import AdmissionDecision
from kai_isolator.shared.failover import ASK_AGAIN_AFTER_S
from kai_isolator.shared.tasks import cancel_all

from .answer import DecisionRecord

log = logging.getLogger(__name__)

EVENT_TYPE = AdmissionDecision.TYPES[0]
DROP_LOG_INTERVAL_S = 10.0
SWEEP_INTERVAL_S = 0.1
# Decisions gather this long before a round of sends: one write and one read of acks serve many, where
# one at a time (a quiet webhook) would cost two system calls and several loop turns each.
LINGER_S = 0.025
# JetStream API errors worth another try (no leader yet, cluster busy); not "insufficient resources".
TRANSIENT_CODES = frozenset({None, 408, 500, 503})
INSUFFICIENT_RESOURCES = 10023
# An ack's duplicate flag, as the server writes it: `"duplicate": true`, with a space (only present when true).
_DUPLICATE = re.compile(rb'"duplicate":\s*true')


@functools.lru_cache(maxsize=1024)
def _subject(namespace: str) -> str:
    return subjects.admission(namespace)


def encode_decision(record: DecisionRecord, source: str, decided_at: float | None = None) -> tuple[str, str, bytes]:
    """Subject, Nats-Msg-Id and the CloudEvent bytes `shared.events.encode` writes for the
    AdmissionDecision of `record` (time: `decided_at`, a POSIX time, or now), without building
    the model (DecodeError: no subject for it). tests/unit/admission/test_publisher.py holds the
    two to the same event."""
    uid, namespace, pod_name = record.request_uid, record.namespace, record.pod_name
    subject = _subject(namespace)
    msg_id = f"admission:{uid}"  # AdmissionDecision.dedup_id
    data = {
        "request_uid": uid, "namespace": namespace, "pod_name": pod_name, "decision": record.decision,
        "reason": record.reason, "container": record.container, "findings": record.findings,
        "patch_operations": record.patch_operations,
    }
    envelope = {
        "specversion": "1.0", "id": msg_id, "source": source, "type": EVENT_TYPE, "subject": f"{namespace}/{pod_name}",
        "time": datetime.fromtimestamp(time.time() if decided_at is None else decided_at, timezone.utc),
        "datacontenttype": "application/json", "data": data,
    }
    return subject, msg_id, orjson.dumps(envelope, option=orjson.OPT_UTC_Z)


@dataclass
class PublishCounters:
    """Where decisions end up, by the names the webhook exports."""

    published: Counter
    dropped: dict[str, Counter]


class _InFlight:
    """One decision sent and not yet acknowledged (or waiting to be sent again)."""

    __slots__ = ("subject", "data", "headers", "deadline", "sent_at", "resend_at", "attempts")

    def __init__(self, subject: str, data: bytes, headers: dict[str, str], deadline: float) -> None:
        self.subject, self.data, self.headers, self.deadline = subject, data, headers, deadline
        self.sent_at = 0.0
        self.resend_at: float | None = None
        self.attempts = 0


class DecisionPublisher:
    """Takes decisions without ever waiting; once the bus is up, sends them pipelined, at most
    `window` unacknowledged, acknowledgements arriving on one subscription of its own."""

    def __init__(self, runtime: Runtime | None, counters: PublishCounters, capacity: int, window: int) -> None:
        self._runtime = runtime
        self._counters = counters
        self._capacity = capacity
        self._window = window
        self._buffer: deque[tuple[DecisionRecord, float]] = deque()  # with when it was decided
        self._inflight: dict[str, _InFlight] = {}
        self._next_token = 0
        self._inbox = ""
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._unlogged_drops = 0
        self._drop_logged_at = float("-inf")
        published = runtime.metrics.published if runtime is not None else None
        self._outcomes = {k: published.labels(k) for k in ("stored", "duplicate", "retried", "failed")} if published else {}
        self._tally: Tally[str] = Tally()  # acks counted here, added to the metrics by the sweep: a Counter locks per inc
        self.bus_ready = asyncio.Event()

    @property
    def pending(self) -> int:
        """Decisions waiting for the bus: buffered, or sent and not yet acknowledged."""
        return len(self._buffer) + len(self._inflight)

    def offer(self, record: DecisionRecord) -> None:
        if self._runtime is None:
            self._counters.dropped["no_bus"].inc()
        elif len(self._buffer) + len(self._inflight) >= self._capacity:
            self._drop_full()
        else:
            self._buffer.append((record, time.time()))
            if not self._wake.is_set():
                self._wake.set()

    def _drop_full(self) -> None:
        self._counters.dropped["queue_full"].inc()
        self._unlogged_drops += 1
        now = time.monotonic()
        if now - self._drop_logged_at >= DROP_LOG_INTERVAL_S:
            log.warning("decision buffer full; decisions dropped", extra={"dropped": self._unlogged_drops, "capacity": self._capacity})
            self._unlogged_drops, self._drop_logged_at = 0, now

    def start(self) -> None:
        if self._runtime is not None:
            self._tasks = [asyncio.create_task(self._run(), name="admission-publisher")]

    async def stop(self, grace_s: float = 2.0) -> None:
        """Publish what is waiting for a moment if the bus is up, then give the rest up as dropped."""
        if self.bus_ready.is_set():
            deadline = time.monotonic() + grace_s
            while self.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        # The sweep too, ended here: a cancellation landing inside the NATS client can be swallowed once.
        await cancel_all(self._tasks, recancel_s=0.1)
        if self._outcomes:
            self._count_acks()
        for _ in range(self.pending):
            self._counters.dropped["publish_failed"].inc()
        self._buffer.clear()
        self._inflight.clear()

    # --- the sending side ------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._runtime is not None
        await self.bus_ready.wait()
        connection = self._runtime.connection
        self._inbox = connection.new_inbox()
        await connection.subscribe(f"{self._inbox}.*", cb=self._on_ack, pending_msgs_limit=0, pending_bytes_limit=0)
        self._tasks.append(asyncio.create_task(self._sweep(), name="admission-publisher-sweep"))
        forget = self._runtime.on_disconnected(self._send_all_again)
        forget_leaders = self._runtime.on_healed(self._send_waiting_again)
        try:
            while True:
                await self._wake.wait()
                await asyncio.sleep(LINGER_S)
                self._wake.clear()
                await self._send_buffered()
        finally:
            forget()
            forget_leaders()

    async def _send_buffered(self) -> None:
        assert self._runtime is not None
        source, buffer, room = self._runtime.service, self._buffer, self._window - len(self._inflight)
        now = time.monotonic()
        deadline = now + self._runtime.settings.publish_retry_s
        entries: list[_InFlight] = []
        while buffer and len(entries) < room:
            record, decided_at = buffer.popleft()
            try:
                subject, msg_id, data = encode_decision(record, source, decided_at)
            except DecodeError:
                self._counters.dropped["unroutable"].inc()  # no namespace a subject can carry
                continue
            entries.append(_InFlight(subject, data, {"Nats-Msg-Id": msg_id, "Content-Type": HEADERS_CONTENT_TYPE}, deadline))
        await self._send(entries, now)

    async def _send(self, entries: list[_InFlight], now: float) -> None:
        """Send these together, each under a reply token of its own."""
        assert self._runtime is not None
        messages: list[frames.Message] = []
        for entry in entries:
            self._next_token += 1
            token = str(self._next_token)
            self._inflight[token] = entry
            entry.sent_at, entry.resend_at = now, None
            entry.attempts += 1
            messages.append((entry.subject, entry.data, f"{self._inbox}.{token}", entry.headers))
        try:
            await frames.publish_many(self._runtime.connection, messages)
        except nats.errors.Error:
            for entry in entries:  # disconnected with the client's own buffer full, or closing
                self._retry_later(entry)  # any already queued is stored once: its Nats-Msg-Id is the same

    # --- acknowledgements, timeouts and retries ----------------------------------------------

    async def _on_ack(self, msg: Msg) -> None:
        entry = self._inflight.pop(msg.subject[len(self._inbox) + 1:], None)
        if entry is None:
            return  # the ack of a send already given up on or sent again
        data = msg.data
        if not data or b'"error"' in data:
            if _transient(data):
                self._reinsert(entry)
            else:
                self._counters.dropped["publish_failed"].inc()
                self._runtime_outcome("failed")
        else:
            self._tally["duplicate" if _DUPLICATE.search(data) else "stored"] += 1
            if not self._inflight:
                self._count_acks()  # the round is in: the counts are current whenever nothing is outstanding
        if self._buffer and not self._wake.is_set():
            self._wake.set()

    async def _send_all_again(self) -> None:
        """The connection dropped: acks still due may never come; the sweep sends those decisions again
        at once (stored once: their Nats-Msg-Id is the same) instead of after the ack timeout."""
        now = time.monotonic()
        for entry in self._inflight.values():
            if entry.resend_at is None:
                entry.resend_at = now

    async def _send_waiting_again(self) -> None:
        """A stream leader was elected or the connection is back: what a leader-less stream refused goes again at
        once rather than at its backoff, and what has waited a moment for its ack (its leader may be gone) too."""
        now = time.monotonic()
        for entry in self._inflight.values():
            if entry.resend_at is not None or now - entry.sent_at >= ASK_AGAIN_AFTER_S:
                entry.resend_at = now

    def _reinsert(self, entry: _InFlight) -> None:
        self._next_token += 1
        self._inflight[f"retry-{self._next_token}"] = entry
        self._retry_later(entry)

    def _retry_later(self, entry: _InFlight) -> None:
        assert self._runtime is not None
        settings = self._runtime.settings
        entry.resend_at = time.monotonic() + min(settings.backoff_base_s * 2 ** (entry.attempts - 1), 2.0)

    async def _sweep(self) -> None:
        """Send again what timed out or was refused for now; give up what is past its deadline."""
        assert self._runtime is not None
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now, ack_timeout = time.monotonic(), self._runtime.settings.jetstream_timeout_s
            again: list[_InFlight] = []
            for token, entry in list(self._inflight.items()):
                if entry.resend_at is None and now - entry.sent_at >= ack_timeout:
                    self._retry_later(entry)
                if entry.resend_at is None or entry.resend_at > now:
                    continue
                del self._inflight[token]
                if now >= entry.deadline:
                    self._counters.dropped["publish_failed"].inc()
                    self._runtime_outcome("failed")
                else:
                    self._runtime_outcome("retried")
                    again.append(entry)
            await self._send(again, now)
            if self._buffer:
                self._wake.set()
            self._count_acks()

    def _count_acks(self) -> None:
        stored, duplicate = self._tally.pop("stored", 0), self._tally.pop("duplicate", 0)
        if stored or duplicate:
            self._counters.published.inc(stored + duplicate)
            self._outcomes["stored"].inc(stored)
            self._outcomes["duplicate"].inc(duplicate)

    def _runtime_outcome(self, outcome: str) -> None:
        self._outcomes[outcome].inc()  # the bus's own count, as Runtime.publish keeps it


def _transient(data: bytes) -> bool:
    """An empty reply is the server's "no responders" (no stream leader yet); an API error may be transient."""
    if not data:
        return True
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
        error = orjson.loads(data)["error"]
        if error.get("err_code") == DUPLICATE_IN_PROCESS:
            return True  # 409: the first send still being replicated (its leader killed or partitioned): ask again
        return error.get("code") in TRANSIENT_CODES and error.get("err_code") != INSUFFICIENT_RESOURCES
    return False

