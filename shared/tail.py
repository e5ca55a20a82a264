"""Follow the event stream from any NATS server: the library behind `kai-isolator events`; or read all it holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

import nats

from . import subjects
from .bus import connect, end_connection
from .errors import BusError, ConfigError, DecodeError
from .events import Envelope, Payload, decode
from .settings import BusSettings, parse_duration

log = logging.getLogger(__name__)


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """`10m`, `90s`, `2h`, `1d` ago, or an ISO-8601 instant."""
    now = now or datetime.now(timezone.utc)
    with contextlib.suppress(ConfigError):
        return now - timedelta(seconds=parse_duration(value))
    try:
        instant = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ConfigError(f"--since expects a duration like 10m / 2h or an ISO time, got {value!r}") from None
    return instant if instant.tzinfo else instant.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class Received:
    """One message from the stream: decoded when possible, the raw bytes and the error otherwise."""

    subject: str
    raw: bytes
    envelope: Envelope | None = None
    payload: Payload | None = None
    error: str | None = None


async def follow(url: str, subject: str = subjects.ALL_EVENTS, since: datetime | None = None,
                 settings: BusSettings | None = None) -> AsyncIterator[Received]:
    """Yield events on `subject`, replaying from `since` if given, then live ones, forever.

    `url` is one NATS URL or several, comma separated. Each event is yielded once, in stream
    order, through NATS restarts and lost consumers.
    """
    settings = settings or BusSettings()
    nc = await connect(settings, url, "kai-isolator-events")
    follower = _Follower(nc.jetstream(timeout=settings.jetstream_timeout_s), subject)
    try:
        await follower.start(since)
        while True:
            for msg in await follower.next_batch():
                yield _received(msg)
    finally:
        await follower.close()
        await end_connection(nc)  # even while reconnecting: no reconnect loop outlives the reader


READ_ATTEMPTS = 10


async def read_stream(url: str, filter_subject: str = subjects.ALL_EVENTS) -> list[Msg]:
    """Every message under `filter_subject` the stream holds now, in stream order (an ephemeral consumer read to the end).

    Read again from the start when the cluster answers "not now" or does not answer the consumer's creation in time:
    a consumer placed while a restarted server catches up (a loaded run waited past 5 s). BusError after READ_ATTEMPTS.
    """
    refusal: Exception | None = None
    for _ in range(READ_ATTEMPTS):
        nc = await nats.connect(url.split(","))
        try:
            psub = await nc.jetstream(timeout=5).pull_subscribe(
                filter_subject, stream=subjects.STREAM_NAME, config=ConsumerConfig(ack_policy=AckPolicy.ALL))
            found: list[Msg] = []
            while True:
                try:
                    batch = await psub.fetch(1000, timeout=1.5)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    return found  # nothing more within the wait: the end
                found += batch
                await batch[-1].ack()  # AckAll: the consumer's 1000 unacked messages would stop it
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError) as error:  # the fetch's own timeout ends the read above
            refusal = error
            await asyncio.sleep(0.5)
        finally:
            await nc.close()
    raise BusError(f"the stream could not be read under {filter_subject}: {refusal!r}")


def _received(msg: Msg) -> Received:
    try:
        envelope, payload = decode(msg.data)
    except DecodeError as error:
        return Received(msg.subject, msg.data, error=str(error))
    return Received(msg.subject, msg.data, envelope, payload)


class _Follower:
    """An ephemeral pull consumer that this reader positions itself, by stream sequence.

    nats-py's ordered consumer cannot be used here: when it re-creates a lost consumer it
    keeps the start time and adds a start sequence, which the server rejects, so a reader
    started with `since` never resumes. Here the last delivered sequence is ours, and a lost
    consumer (NATS restarted, or it was reaped) is created again just after it.
    """

    FETCH_WAIT_S = 1.0  # how long one pull waits for new events before the consumer is checked
    INACTIVE_S = 60.0  # the server removes the consumer this long after the reader is gone

    def __init__(self, js: JetStreamContext, subject: str) -> None:
        self.js = js
        self.subject = subject
        self.last_sequence = 0
        self._sub: JetStreamContext.PullSubscription | None = None
        self._consumer: str | None = None

    async def start(self, since: datetime | None) -> None:
        if since is None:
            policy, start = DeliverPolicy.NEW, {}
        else:
            policy = DeliverPolicy.BY_START_TIME
            start = {"opt_start_time": since.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")}
        await self._create(policy, start)

    async def _create(self, policy: DeliverPolicy, start: dict[str, object]) -> None:
        """Create the consumer, waiting for the stream (a fresh server has none until a service starts)."""
        config = ConsumerConfig(
            deliver_policy=policy, ack_policy=AckPolicy.NONE, filter_subject=self.subject,
            mem_storage=True, num_replicas=1, inactive_threshold=self.INACTIVE_S, **start,  # type: ignore[arg-type]
        )
        announced = False
        while True:
            try:
                info = await self.js.add_consumer(subjects.STREAM_NAME, config)
                break
            except nats.js.errors.NotFoundError:
                if not announced:
                    log.info("event stream does not exist yet; waiting for a service to create it", extra={"stream": subjects.STREAM_NAME})
                    announced = True
            except (nats.errors.Error, asyncio.TimeoutError) as error:
                log.debug("cannot create the event consumer yet", extra={"error": repr(error)})
            await asyncio.sleep(1.0)
        if policy is not DeliverPolicy.BY_START_SEQUENCE:
            # The server reports the sequence just before where it starts: our position from now on.
            self.last_sequence = info.delivered.stream_seq
        self._consumer = info.name
        self._sub = await self.js.pull_subscribe_bind(consumer=info.name, stream=subjects.STREAM_NAME)

    async def _recreate(self) -> None:
        log.info("event consumer lost; resuming after the last event read", extra={"sequence": self.last_sequence})
        await self._drop_subscription()
        await self._create(DeliverPolicy.BY_START_SEQUENCE, {"opt_start_seq": self.last_sequence + 1})

    async def next_batch(self) -> list[Msg]:
        """The next events after the last one returned (waits for them)."""
        assert self._sub is not None
        while True:
            try:
                batch = await self._sub.fetch(64, timeout=self.FETCH_WAIT_S)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                # Quiet, or NATS is away: make sure the consumer still exists before waiting again.
                if not await self._consumer_exists():
                    await self._recreate()
                continue
            except nats.js.errors.ServiceUnavailableError:
                await self._recreate()  # nobody serves the consumer's pull subject: it is gone
                continue
            except nats.errors.Error as error:
                log.debug("fetch failed; retrying", extra={"error": repr(error)})
                await asyncio.sleep(0.5)
                continue
            fresh = [m for m in batch if m.metadata.sequence.stream > self.last_sequence]
            if fresh:
                self.last_sequence = fresh[-1].metadata.sequence.stream
                return fresh

    async def _consumer_exists(self) -> bool:
        assert self._consumer is not None
        try:
            await self.js.consumer_info(subjects.STREAM_NAME, self._consumer)
        except nats.js.errors.NotFoundError:
            return False
        except (nats.errors.Error, asyncio.TimeoutError):
            return True  # cannot tell while NATS is away; ask again after the next pull
        return True

    async def _drop_subscription(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error, ValueError):
                await self._sub.unsubscribe()
        self._sub = None

    async def close(self) -> None:
        await self._drop_subscription()
        if self._consumer is not None:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await self.js.delete_consumer(subjects.STREAM_NAME, self._consumer)


def render_line(item: Received, as_json: bool) -> str:
    """One line per event: the envelope itself in JSON mode, a readable summary otherwise."""
    if as_json:
        return item.raw.decode("utf-8", "replace")
    if item.envelope is None or item.payload is None:
        return f"!! undecodable message on {item.subject}: {item.error}"
    stamp = item.envelope.time.astimezone(timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    about = item.envelope.subject or item.subject
    return f"{stamp}  {item.envelope.type:45}  {about:30}  {summarise(item.payload)}"


def summarise(payload: Payload) -> str:
    fields = payload.model_dump(mode="json", exclude_defaults=True, exclude={"pod"})
    return " ".join(f"{key}={value}" for key, value in fields.items())
