"""Riding out a lost NATS server: a JetStream call that meets a leader election waits for it, bounded, then goes on.

A three-server cluster that loses one server for good keeps a quorum, and every R3 stream and bucket the lost
server led elects a new leader among the other two (nats-server's election timeouts: seconds, longer on a loaded
machine). Meanwhile a client meets two things (bench/cluster.py, its `down` part, measures both):

- a publish or KV write to a stream or bucket without a leader is answered at once with "no responders" (503),
  and nats-py raises at once: until now each caller's own backoff decided when to ask again, up to several
  seconds after the new leader was there;
- a read (stream info, a KV get) sent while its stream has no leader, and any request in flight when its server
  or its stream's leader was lost, gets no answer at all, and was given up only after its whole timeout
  (`KAI_ISOLATOR_JETSTREAM_TIMEOUT_S`), although the new leader, or the client's connection to another server,
  was there much sooner.

The cluster announces each new leader (`$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.<stream>`, and one per
consumer), and the client knows when it has reconnected. `Healing` turns both into one signal;
`ElectionAwareJetStream`, the context every service's runtime hands out (KV buckets included), waits on it: a
call answered "no responders" or "temporarily unavailable" is asked again at the next signal (or after `POLL_S`,
for a user not allowed the advisories), and a call still unanswered when a signal comes, or `ECHO_S` after it, is
asked again at once, all within `KAI_ISOLATOR_NATS_ELECTION_WAIT_S`. A call that times out with no signal fails as
before, so a NATS that is away altogether is still reported after the JetStream timeout.

Asking again is safe for what goes through here: reads change nothing; the services' publishes carry a
`Nats-Msg-Id` (stored once); a KV compare-and-set whose first copy landed is refused as one, which its callers
already recognise (a lease renewal, a verifier claim); a plain KV put stored twice holds the same value.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext, api

T = TypeVar("T")

LEADER_ELECTED = "$JS.EVENT.ADVISORY.*.LEADER_ELECTED.>"
"""Every stream's (`STREAM.LEADER_ELECTED.<stream>`) and consumer's (`CONSUMER.LEADER_ELECTED.<stream>.<consumer>`) new leader."""

POLL_S = 0.25
"""How soon a call answered "no leader" asks again when no advisory comes (a user without the permission): a
"no responders" answer costs the server one interest lookup."""

ASK_AGAIN_AFTER_S = 0.1
"""A call sent this recently is not asked again at a signal: a burst of advisories (one per stream and consumer the
lost server led) then sends each waiting call once more, not once per advisory."""

ECHO_S = 1.0
"""The signal is given once more this long after the last of a burst: a leader just elected may not yet serve what
reaches it in its first moment, and a call sent then would otherwise wait out its whole timeout."""

NOT_NOW = (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)
"""Answers meaning nobody serves it this moment: no stream leader (publishes, KV writes), or JetStream itself
electing (503 to an API request)."""


class Healing:
    """Moments when what was waiting on the cluster may go on: a JetStream leader elected, the connection back.

    Calls ridden through `ride()` in flight at such a moment are asked again at once; `wait()` wakes at the next one.
    """

    def __init__(self) -> None:
        self.count = 0
        """Signals so far (the runtime's metrics and the tests read it)."""
        self._next = asyncio.Event()
        self._waiting: dict[asyncio.Future[Any], float] = {}
        """Calls awaiting their answer, with when each was sent."""
        self._asked_again: set[asyncio.Future[Any]] = set()

    def heal(self, reconnected: bool = False) -> None:
        """Wake every waiter and send again each call that has waited a moment already; `reconnected`: every call,
        however recent, for the connection it went out on is gone (a reconnect takes milliseconds on a refused port)."""
        self.count += 1
        self._next.set()
        self._next = asyncio.Event()
        now = time.monotonic()
        for attempt, sent_at in list(self._waiting.items()):
            if (reconnected or now - sent_at >= ASK_AGAIN_AFTER_S) and not attempt.done():
                self._asked_again.add(attempt)
                attempt.cancel()

    async def wait(self, timeout_s: float) -> bool:
        """Until the next signal (True) or `timeout_s` (False)."""
        signal = self._next
        if timeout_s <= 0:
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(signal.wait(), timeout_s)
            return True
        return False

    async def ride(self, call: Callable[[], Awaitable[T]], nc: NatsClient, wait_s: float) -> T:
        """`call()`'s answer, asked again while nobody serves it (at each signal, or every POLL_S) and at once when a
        signal comes while it waits, for at most `wait_s`; then its error as it is."""
        deadline = time.monotonic() + wait_s
        me = asyncio.current_task()
        while True:
            attempt = asyncio.ensure_future(call())
            if time.monotonic() < deadline:
                self._waiting[attempt] = time.monotonic()
            try:
                return await attempt
            except asyncio.CancelledError:
                if attempt not in self._asked_again or (me is not None and me.cancelling()):
                    raise
            except NOT_NOW:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or nc.is_closed:
                    raise
                await self.wait(min(POLL_S, remaining))
            finally:
                self._waiting.pop(attempt, None)
                self._asked_again.discard(attempt)


class ElectionAwareJetStream(JetStreamContext):
    """nats-py's JetStream context whose publishes (KV writes included), stream and consumer infos and message reads
    (KV reads included) ride out a leader election (`Healing.ride`); everything else is nats-py's own."""

    def __init__(self, nc: NatsClient, healing: Healing, *, timeout: float, election_wait_s: float) -> None:
        super().__init__(nc, timeout=timeout)
        self.healing = healing
        self.election_wait_s = election_wait_s

    def _ride(self, call: Callable[[], Awaitable[T]]) -> Awaitable[T]:
        return self.healing.ride(call, self._nc, self.election_wait_s)

    # Arguments passed through as given: nats-py's signatures grow from version to version.
    async def publish(self, *args: Any, **kwargs: Any) -> api.PubAck:
        send = super().publish
        return await self._ride(lambda: send(*args, **kwargs))

    async def publish_until(self, deadline: float, *args: Any, **kwargs: Any) -> api.PubAck:
        """`publish`, riding out an election no later than `deadline` (time.monotonic()): a caller's own bound."""
        send = super().publish
        wait_s = min(self.election_wait_s, max(0.0, deadline - time.monotonic()))
        return await self.healing.ride(lambda: send(*args, **kwargs), self._nc, wait_s)

    async def stream_info(self, *args: Any, **kwargs: Any) -> api.StreamInfo:
        ask = super().stream_info
        return await self._ride(lambda: ask(*args, **kwargs))

    async def consumer_info(self, *args: Any, **kwargs: Any) -> api.ConsumerInfo:
        ask = super().consumer_info
        info: api.ConsumerInfo = await self._ride(lambda: ask(*args, **kwargs))
        return info

    async def get_msg(self, *args: Any, **kwargs: Any) -> api.RawStreamMsg:
        ask = super().get_msg
        return await self._ride(lambda: ask(*args, **kwargs))
