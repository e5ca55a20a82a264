"""Pipelined JetStream publishes: every ack comes back on one subscription, no request/timer/task per message.

Bounded: at most `limit` publishes await their ack; a missing ack fails its publish after `timeout_s`.
A lost connection, or a new stream leader, sends what awaits its ack again at once (`resend`), instead of each
waiting out `timeout_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kai_isolator.shared import frames

STATUS_HEADER = "Status"
NO_RESPONDERS = "503"


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    duplicate: bool


class _Waiting:
    """One publish sent and awaiting its ack: what to send again if the connection drops."""

    __slots__ = ("future", "subject", "data", "headers", "token", "sent_at")

    def __init__(self, future: asyncio.Future[Ack], subject: str, data: bytes, headers: dict[str, str], token: str) -> None:
        self.future, self.subject, self.data, self.headers, self.token = future, subject, data, headers, token
        self.sent_at = time.monotonic()


class AckPipeline:
    """`publish()` awaits the stream's ack as `js.publish` would, while many of them are in flight at once."""

    def __init__(self, nc: NatsClient, timeout_s: float, limit: int = 1024) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self._room = asyncio.Semaphore(limit)
        self._prefix = ""
        self._tokens = itertools.count()
        self._waiting: dict[str, _Waiting] = {}
        self._deadlines: deque[tuple[float, str]] = deque()  # send order is deadline order: one timeout for all
        self._subscription: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._prefix = self.nc.new_inbox() + "."
        self._subscription = await self.nc.subscribe(self._prefix + "*", cb=self._on_ack)
        self._sweeper = asyncio.create_task(self._sweep(), name="ack-timeouts")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except nats.errors.Error:
                pass  # the connection is closing or closed
        self._fail_all(nats.errors.ConnectionClosedError())

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> Ack:
        """Store one message; nats.js.errors.APIError for the stream's refusal, TimeoutError, or a nats error."""
        async with self._room:
            waiting = _Waiting(asyncio.get_running_loop().create_future(), subject, data, headers, str(next(self._tokens)))
            self._waiting[waiting.token] = waiting
            self._deadlines.append((time.monotonic() + self.timeout_s, waiting.token))
            try:
                await frames.publish(self.nc, subject, data, self._prefix + waiting.token, headers)
                return await waiting.future
            finally:
                self._waiting.pop(waiting.token, None)

    async def resend(self, waited_s: float = 0.0) -> None:
        """The connection dropped, or a stream has a new leader: the acks awaited may never come (the server that
        took the messages, or the leader they went to, may be gone). Each message sent at least `waited_s` ago is
        sent again now, under a new reply token and deadline; the client keeps it until it has reconnected. The
        stream stores it once: its Nats-Msg-Id is the same, and a compare-and-set that had landed is refused as
        one (the caller recognises its own write)."""
        now = time.monotonic()
        for waiting in list(self._waiting.values()):
            if waiting.future.done() or now - waiting.sent_at < waited_s:
                continue
            del self._waiting[waiting.token]
            waiting.token = str(next(self._tokens))
            waiting.sent_at = now
            self._waiting[waiting.token] = waiting
            self._deadlines.append((now + self.timeout_s, waiting.token))
            try:
                await frames.publish(self.nc, waiting.subject, waiting.data, self._prefix + waiting.token, waiting.headers)
            except nats.errors.Error as error:  # closed, or no room left in the client's buffer: the caller decides
                self._waiting.pop(waiting.token, None)
                waiting.future.set_exception(error)

    async def _on_ack(self, msg: Msg) -> None:
        waiting = self._waiting.pop(msg.subject[len(self._prefix):], None)
        if waiting is None or waiting.future.done():
            return  # timed out already, or the ack of a copy sent before the connection dropped
        try:
            waiting.future.set_result(_ack(msg))
        except Exception as error:  # noqa: BLE001 - whatever the answer, its publish must not wait for ever
            waiting.future.set_exception(error)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(0.1, self.timeout_s / 4))
            now = time.monotonic()
            while self._deadlines and self._deadlines[0][0] <= now:
                waiting = self._waiting.pop(self._deadlines.popleft()[1], None)
                if waiting is not None and not waiting.future.done():
                    waiting.future.set_exception(asyncio.TimeoutError())
            if not self._waiting:
                self._deadlines.clear()

    def _fail_all(self, error: Exception) -> None:
        for waiting in self._waiting.values():
            if not waiting.future.done():
                waiting.future.set_exception(error)
        self._waiting.clear()
        self._deadlines.clear()


def _ack(msg: Msg) -> Ack:
    """The stream's answer: its ack, or the error it stands for (raised)."""
    if msg.headers and msg.headers.get(STATUS_HEADER) == NO_RESPONDERS:
        raise nats.js.errors.NoStreamResponseError()
    try:
        answer = orjson.loads(msg.data)
    except orjson.JSONDecodeError:
        raise nats.js.errors.APIError(description=f"unreadable ack: {msg.data[:100]!r}") from None
    error = answer.get("error")
    if error:
        nats.js.errors.APIError.from_error(error)  # raises the error's own class (BadRequestError, ...)
        raise nats.js.errors.APIError(**error)
    return Ack(int(answer.get("seq") or 0), bool(answer.get("duplicate")))
