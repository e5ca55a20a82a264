"""Follow the event stream from any NATS server: the library behind `kai-isolator events`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import nats
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from . import subjects
from .errors import ConfigError, DecodeError
from .settings import parse_duration
from .events import Envelope, Payload, decode

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


async def follow(url: str, subject: str = subjects.ALL_EVENTS, since: datetime | None = None) -> AsyncIterator[Received]:
    """Yield events on `subject`, replaying from `since` if given, then live ones, forever."""
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, name="kai-isolator-events")
    try:
        js = nc.jetstream()
        queue: asyncio.Queue[Received] = asyncio.Queue()

        async def on_message(msg: Msg) -> None:
            try:
                envelope, payload = decode(msg.data)
                await queue.put(Received(msg.subject, msg.data, envelope, payload))
            except DecodeError as error:
                await queue.put(Received(msg.subject, msg.data, error=str(error)))

        if since is None:
            policy, config = DeliverPolicy.NEW, None
        else:
            policy = DeliverPolicy.BY_START_TIME
            config = ConsumerConfig(opt_start_time=since.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"))
        await _subscribe_when_stream_exists(js, subject, on_message, policy, config)
        while True:
            yield await queue.get()
    finally:
        await nc.drain()


async def _subscribe_when_stream_exists(js: JetStreamContext, subject: str, callback: Callable[[Msg], Awaitable[None]], policy: DeliverPolicy, config: ConsumerConfig | None) -> None:
    """A fresh server has no stream until the first service starts; wait for it rather than fail."""
    announced = False
    while True:
        try:
            await js.subscribe(subject, cb=callback, ordered_consumer=True, deliver_policy=policy, config=config, stream=subjects.STREAM_NAME)
            return
        except nats.js.errors.NotFoundError:
            if not announced:
                log.info("event stream does not exist yet; waiting for a service to create it", extra={"stream": subjects.STREAM_NAME})
                announced = True
            await asyncio.sleep(1.0)


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
