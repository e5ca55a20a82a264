"""Publishing a pod's events on the stream, fenced on each subject's last sequence, so a leader paused past its
lease is refused by the server instead of repeating or reordering a pod's story."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nats.js.errors
import orjson

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import HEADERS_CONTENT_TYPE, WRONG_LAST_SEQUENCE, Runtime
from kai_isolator.shared.errors import FencedError, LeaseLostError
from kai_isolator.shared.events import PodIsolation
from kai_isolator.shared.lease import Lease

from .acks import Ack, AckPipeline
from .wire import encode_event


class FencedPublisher:
    """This leader's publishes, each naming the subject's last stream sequence it knows (its tip)."""

    def __init__(self, runtime: Runtime, lease: Lease, emitted: Callable[[str], None]) -> None:
        self.runtime = runtime
        self.lease = lease
        self.acks: AckPipeline | None = None
        """The term's pipeline."""
        self._emitted = emitted
        self._tips: dict[str, tuple[int, str | None]] = {}
        """subject -> (last stream sequence, its event id) as this leader knows it."""
        self._counted: dict[str, Any] = {}

    def forget_all(self) -> None:
        self._tips.clear()

    async def last_id(self, subject: str) -> str | None:
        """The id of the event the stream holds last on `subject` (None: nothing yet), read now and not kept as a tip."""
        return (await self._read_tip(subject))[1]

    async def _tip(self, subject: str) -> tuple[int, str | None]:
        """The subject's last stream sequence and event id: known, or read from the stream."""
        if subject not in self._tips:
            self._tips[subject] = await self._read_tip(subject)
        return self._tips[subject]

    async def _read_tip(self, subject: str) -> tuple[int, str | None]:
        try:
            last = await self.runtime.jetstream.get_last_msg(subjects.STREAM_NAME, subject)
        except nats.js.errors.NotFoundError:
            return 0, None
        return last.seq or 0, orjson.loads(last.data or b"{}").get("id")

    async def publish(self, event: PodIsolation) -> None:
        """Publish unless the subject already ends with this event; fenced on the subject's last sequence.

        A subject this leader has not looked at yet is first tried as empty (a new pod's, the common
        case: one round trip saved); the server refuses that when it is not, and then it is read.
        """
        subject, event_id = event.subject(), event.dedup_id()
        known = self._tips.get(subject)
        if known is not None and known[1] == event_id:
            return  # a previous holder (or our own lost ack) already stored it
        await self.lease.wait_held()
        data = encode_event(event, self.runtime.service)
        try:
            ack = await self._send(subject, data, event_id, known[0] if known else 0)
        except FencedError:
            # Someone else wrote this pod's subject since we looked: only fine if it is this very event.
            self._tips.pop(subject, None)
            seq, last_id = await self._tip(subject)
            if last_id == event_id:
                return
            if known is not None:
                raise LeaseLostError(f"{subject} was written by another watcher; resynchronising from KV") from None
            await self.lease.wait_held()
            try:
                ack = await self._send(subject, data, event_id, seq)
            except FencedError:
                self._tips.pop(subject, None)
                raise LeaseLostError(f"{subject} was written by another watcher; resynchronising from KV") from None
        if ack.duplicate:
            self._tips.pop(subject, None)  # the sequence is the original's, not necessarily the tip
        else:
            self._tips[subject] = (ack.seq, event_id)
        self._emitted(event.state)

    async def _send(self, subject: str, data: bytes, event_id: str, expected_seq: int) -> Ack:
        """One acked publish with the de-duplication id and the fence; FencedError when the subject moved on."""
        assert self.acks is not None
        headers = {"Nats-Msg-Id": event_id, "Content-Type": HEADERS_CONTENT_TYPE, "Nats-Expected-Last-Subject-Sequence": str(expected_seq)}
        try:
            ack = await self.acks.publish(subject, data, headers)
        except nats.js.errors.APIError as error:
            if error.err_code == WRONG_LAST_SEQUENCE:
                self._count("fenced")
                raise FencedError(f"publish to {subject} fenced: {error.description}") from None
            self._count("failed")
            raise
        self._count("duplicate" if ack.duplicate else "stored")
        return ack

    def _count(self, outcome: str) -> None:
        """The runtime's own publish counter, as if its `publish()` had sent it."""
        child = self._counted.get(outcome)
        if child is None:
            child = self._counted[outcome] = self.runtime.metrics.published.labels(outcome)
        child.inc()
