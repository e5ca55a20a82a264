"""Bus runtime: runs a service's handlers on NATS so that a handler is just a typed async function.

The runtime connects (and reconnects), provisions the stream and KV buckets, binds event
handlers to durable pull consumers and request handlers to request/reply subjects, decodes
and validates, acks / naks with backoff / dead-letters, publishes with de-duplication ids,
serves the probes and drains on SIGTERM or SIGINT. Its JetStream context and KV buckets ride out
a lost server's leader elections (shared/failover.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
import types
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, PubAck, StorageType, StreamConfig
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from . import subjects
from .errors import BusError, DecodeError, FencedError, NotYet
from .events import DeadLetter, ErrorReply, Payload, decode, encode
from .failover import ECHO_S, LEADER_ELECTED, ElectionAwareJetStream, Healing
from .probes import ProbeServer
from .settings import BusSettings, nats_servers
from .tasks import cancel_all

log = logging.getLogger(__name__)

HandlerResult = Payload | Iterable[Payload] | None
EventHandler = Callable[[Any], Awaitable[HandlerResult]]
RequestHandler = Callable[[Any], Awaitable[Payload]]

HEADERS_CONTENT_TYPE = "application/cloudevents+json"


def accepted_types(handler: Callable[..., Any]) -> tuple[type[Payload], ...]:
    """The payload classes a handler takes, read from its first parameter's annotation."""
    hints = typing.get_type_hints(handler)
    hints.pop("return", None)
    if not hints:
        raise TypeError(f"handler {handler.__qualname__} needs an annotated payload parameter")
    annotation = next(iter(hints.values()))
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
    if not all(isinstance(m, type) and issubclass(m, Payload) for m in members):
        raise TypeError(f"handler {handler.__qualname__} must take Payload subclasses, not {annotation!r}")
    return tuple(members)


def retry_delay(deliveries: int, settings: BusSettings) -> float:
    """Bounded exponential backoff: base, 2*base, 4*base ... capped."""
    return float(min(settings.backoff_max_s, settings.backoff_base_s * 2 ** max(0, deliveries - 1)))


def as_payloads(result: HandlerResult) -> list[Payload]:
    if result is None:
        return []
    if isinstance(result, Payload):
        return [result]
    return list(result)


@dataclass
class EventBinding:
    durable: str
    filter_subject: str
    handler: EventHandler
    accepts: tuple[type[Payload], ...]
    deliver_policy: DeliverPolicy = DeliverPolicy.ALL
    bound: bool = False


@dataclass
class RequestBinding:
    subject: str
    handler: RequestHandler
    accepts: tuple[type[Payload], ...]
    bound: bool = False


@dataclass
class _Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.handled = Counter("kai_isolator_bus_messages", "Messages handled, by handler and outcome", ["handler", "outcome"], registry=r)
        self.handler_seconds = Histogram("kai_isolator_bus_handler_seconds", "Handler run time", ["handler"], registry=r)
        self.published = Counter("kai_isolator_bus_published", "Events published, by outcome", ["outcome"], registry=r)
        self.connected = Gauge("kai_isolator_bus_connected", "1 while connected to NATS", registry=r)
        self.healed = Counter("kai_isolator_bus_failover_signals", "Moments waiting bus calls went on: a JetStream leader elected, "
                              "the connection back on a server", ["cause"], registry=r)


class Runtime:
    """One service's connection to the bus and the handlers bound on it."""

    def __init__(self, service: str, settings: BusSettings, *, kv_buckets: Iterable[str] = (), probe_listen: str | None = None) -> None:
        self.service = service
        self.settings = settings
        self.kv_buckets = tuple(kv_buckets)
        self.metrics = _Metrics()
        self._probe = ProbeServer(probe_listen, self.metrics.registry, self.not_ready) if probe_listen else None
        self._events: list[EventBinding] = []
        self._requests: list[RequestBinding] = []
        self._broadcasts: list[RequestBinding] = []
        self._nc: NatsClient | None = None
        self._js: ElectionAwareJetStream | None = None
        self.healing = Healing()
        """Wakes what waits on the cluster (a retry, an unanswered call) when a leader is elected or the connection is back."""
        self._kv: dict[str, KeyValue] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._pull_subscriptions: list[JetStreamContext.PullSubscription] = []
        self._stopping = asyncio.Event()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._readiness_checks: list[Callable[[], str | None]] = []
        self._disconnect_listeners: list[Callable[[], Awaitable[None]]] = []
        self._heal_listeners: list[Callable[[], Awaitable[None]]] = []
        self._echo: asyncio.Task[None] | None = None
        self._echo_at = 0.0

    # --- binding ------------------------------------------------------------------------

    def on_event(self, name: str, filter_subject: str, handler: EventHandler, *, new_only: bool = False) -> None:
        """Bind `handler` to a durable consumer `<service>-<name>` of the event stream."""
        policy = DeliverPolicy.NEW if new_only else DeliverPolicy.ALL
        self._events.append(EventBinding(f"{self.service}-{name}", filter_subject, handler, accepted_types(handler), policy))

    def on_disconnected(self, listener: Callable[[], Awaitable[None]]) -> Callable[[], None]:
        """Await `listener` each time the connection drops, until the function returned is called.

        What was sent and not yet acknowledged may never be (the server it went to may be gone):
        a pipelined sender can send it again at once rather than wait out its ack timeout. It runs
        before the client reconnects: what it sends is kept in the client's buffer and goes out first."""
        self._disconnect_listeners.append(listener)

        def forget() -> None:
            if listener in self._disconnect_listeners:
                self._disconnect_listeners.remove(listener)

        return forget

    def on_healed(self, listener: Callable[[], Awaitable[None]]) -> Callable[[], None]:
        """Await `listener` each time a JetStream leader is elected or the connection is back, until the function
        returned is called: a pipelined sender sends again what still awaits its ack (its stream may have a new
        leader that never saw it) rather than wait out its ack timeout."""
        self._heal_listeners.append(listener)

        def forget() -> None:
            if listener in self._heal_listeners:
                self._heal_listeners.remove(listener)

        return forget

    def on_broadcast(self, subject: str, handler: EventHandler) -> None:
        """Every event on `subject` to this instance too, by a plain subscription (no consumer, no queue group).

        For state each replica must keep whole while durable consumers split the events between
        replicas: at most once and only while connected, so for views the next report repairs.
        """
        self._broadcasts.append(RequestBinding(subject, handler, accepted_types(handler)))

    def on_request(self, subject: str, handler: RequestHandler) -> None:
        """Answer requests on `subject` (one responder per service instance group)."""
        self._requests.append(RequestBinding(subject, handler, accepted_types(handler)))

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def probe_url(self) -> str:
        return self._probe.url if self._probe else ""

    def not_ready(self) -> list[str]:
        missing = []
        if self._nc is None or not self._nc.is_connected:
            missing.append("bus not connected")
        missing += [f"consumer {b.durable} not bound" for b in self._events if not b.bound]
        missing += [f"responder {b.subject} not bound" for b in self._requests if not b.bound]
        missing += [f"subscription {b.subject} not bound" for b in self._broadcasts if not b.bound]
        missing += [problem for check in self._readiness_checks if (problem := check())]
        return missing

    def add_readiness_check(self, check: Callable[[], str | None]) -> None:
        """A service's own condition for /readyz: returns what is not ready yet, or None."""
        self._readiness_checks.append(check)

    async def start(self, url: str) -> None:
        if self._probe:
            await self._probe.start()
        self._nc = await self._connect(url)
        self._js = ElectionAwareJetStream(self._nc, self.healing, timeout=self.settings.jetstream_timeout_s,
                                          election_wait_s=self.settings.nats_election_wait_s)
        # Every new stream or consumer leader is a moment to go on. A user not allowed these advisories gets a
        # permissions error here and nothing more: calls then poll for the new leader instead.
        await self._nc.subscribe(LEADER_ELECTED, cb=self._on_leader_elected)
        await self._provision()
        for binding in self._events:
            psub = await self._bind_consumer(binding)
            self._pull_subscriptions.append(psub)
            self._tasks.append(asyncio.create_task(self._consume(binding, psub), name=binding.durable))
        for request in self._requests:
            await self._nc.subscribe(request.subject, queue=self.service, cb=self._responder(request))
            request.bound = True
        for broadcast in self._broadcasts:
            await self._nc.subscribe(broadcast.subject, cb=self._broadcast_receiver(broadcast))
            broadcast.bound = True
        log.info("service bound to the bus", extra={"service": self.service, "consumers": len(self._events), "responders": len(self._requests)})

    async def stop(self) -> None:
        """Finish the messages being handled, ack them, then drain the connection (idempotent)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._echo is not None:
            await cancel_all([self._echo])
        for task in self._tasks:
            await task
        for psub in self._pull_subscriptions:
            with contextlib.suppress(nats.errors.Error):
                await psub.unsubscribe()
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        if self._nc is not None:
            await end_connection(self._nc)
        if self._probe:
            await self._probe.stop()
        log.info("service stopped", extra={"service": self.service})

    async def run(self, url: str) -> None:
        """Start, serve until SIGTERM/SIGINT, then stop gracefully."""
        with stop_signals() as stop:
            await self.start(url)
            await stop.wait()
        await self.stop()

    async def _connect(self, url: str) -> NatsClient:
        return await connect(self.settings, url, self.service, disconnected_cb=self._on_disconnect,
                             reconnected_cb=self._on_reconnect, error_cb=self._on_error)

    async def _on_disconnect(self) -> None:
        self.metrics.connected.set(0)
        for listener in list(self._disconnect_listeners):
            try:
                await listener()
            except Exception:  # noqa: BLE001 - the client awaits this before reconnecting: it must go on
                log.exception("disconnect listener failed", extra={"service": self.service})
        if not self._stopping.is_set():
            log.warning("disconnected from NATS; reconnecting", extra={"service": self.service})

    async def _on_reconnect(self) -> None:
        self.metrics.connected.set(1)
        log.info("reconnected to NATS", extra={"service": self.service, "server": _server_of(self._nc)})
        await self._heal("reconnected")

    async def _on_leader_elected(self, msg: Msg) -> None:
        log.debug("JetStream leader elected", extra={"service": self.service, "advisory": msg.subject})
        await self._heal("leader_elected")

    async def _heal(self, cause: str) -> None:
        self.metrics.healed.labels(cause).inc()
        await self._go_on(reconnected=cause == "reconnected")
        # Once more a moment after the last signal of a burst: a leader just elected may not yet serve what reaches it
        # (seen: a KV read sent at the advisory unanswered for the whole JetStream timeout).
        self._echo_at = time.monotonic() + ECHO_S
        if (self._echo is None or self._echo.done()) and not self._stopping.is_set():
            self._echo = asyncio.create_task(self._go_on_later(), name=f"{self.service}-failover-echo")

    async def _go_on(self, reconnected: bool = False) -> None:
        self.healing.heal(reconnected=reconnected)
        for listener in list(self._heal_listeners):
            try:
                await listener()
            except Exception:  # noqa: BLE001 - one listener's failure must not keep the others waiting
                log.exception("failover listener failed", extra={"service": self.service})

    async def _go_on_later(self) -> None:
        while (wait_s := self._echo_at - time.monotonic()) > 0:  # moved on by each signal of the burst
            await asyncio.sleep(wait_s)
        await self._go_on()

    async def _on_error(self, error: Exception) -> None:
        log.debug("NATS client error", extra={"service": self.service, "error": repr(error)})

    async def _provision(self) -> None:
        """Create or update the stream and KV buckets; safe to run from every replica at once.

        With nats-py's own context: provisioning has its own bounded retries (PROVISION_ATTEMPTS); the buckets it
        returns go through the runtime's, so their reads and writes ride out an election."""
        assert self._nc is not None and self._js is not None
        plain = self._nc.jetstream(timeout=self.settings.jetstream_timeout_s)
        await provision_stream(plain, self.settings)
        for bucket in self.kv_buckets:
            self._kv[bucket] = await provision_bucket(plain, bucket, self.settings, bind=self._js)
        self.metrics.connected.set(1)

    async def _bind_consumer(self, binding: EventBinding) -> JetStreamContext.PullSubscription:
        assert self._js is not None
        config = ConsumerConfig(
            durable_name=binding.durable,
            filter_subject=binding.filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait_s,
            max_deliver=self.settings.max_deliver,
            deliver_policy=binding.deliver_policy,
        )
        # As provisioning does: a cluster just formed or electing may time out the consumer's info/create
        # (seen: a verifier replica exiting at start beside another on a new three-node cluster).
        for attempt in range(PROVISION_ATTEMPTS):
            try:
                psub = await self._js.pull_subscribe(binding.filter_subject, durable=binding.durable, stream=subjects.STREAM_NAME, config=config)
                break
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
        else:
            raise BusError(f"cannot bind consumer {binding.durable}: JetStream kept timing out or being unavailable")
        binding.bound = True
        return psub

    # --- consuming ----------------------------------------------------------------------

    async def _consume(self, binding: EventBinding, psub: JetStreamContext.PullSubscription) -> None:
        while not self._stopping.is_set():
            try:
                batch = await psub.fetch(self.settings.fetch_batch, timeout=0.5)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error as error:
                # Disconnected or reconnecting: the client reconnects on its own; just wait.
                log.debug("fetch failed", extra={"consumer": binding.durable, "error": repr(error)})
                await asyncio.sleep(0.2)
                continue
            for msg in batch:
                if self._stopping.is_set():
                    # Hand back what we will not get to, so another replica takes it at once.
                    await self._settle(msg.nak(), binding, "returned")
                else:
                    await self._deliver(binding, msg)

    async def _deliver(self, binding: EventBinding, msg: Msg) -> None:
        deliveries = msg.metadata.num_delivered
        try:
            _, payload = decode(msg.data)
        except DecodeError as error:
            await self._dead_letter(binding, msg, f"undecodable: {error}")
            return
        if not isinstance(payload, binding.accepts):
            await self._settle(msg.ack(), binding, "skipped")
            return
        started = time.perf_counter()
        try:
            for event in as_payloads(await binding.handler(payload)):
                await self.publish(event)
        except Exception as error:  # noqa: BLE001 - any handler failure is a retry, never a crash
            self.metrics.handler_seconds.labels(binding.durable).observe(time.perf_counter() - started)
            await self._retry_or_dead_letter(binding, msg, deliveries, error)
            return
        self.metrics.handler_seconds.labels(binding.durable).observe(time.perf_counter() - started)
        await self._settle(msg.ack(), binding, "ok")

    async def _retry_or_dead_letter(self, binding: EventBinding, msg: Msg, deliveries: int, error: Exception) -> None:
        reason = f"{type(error).__name__}: {error}"
        if deliveries >= self.settings.max_deliver and isinstance(error, NotYet):
            log.info("still not ready; left to the handler's own later look", extra={
                "consumer": binding.durable, "deliveries": deliveries, "why": str(error)})
            await self._settle(msg.ack(), binding, "handed_over")
            return
        if deliveries >= self.settings.max_deliver:
            await self._dead_letter(binding, msg, f"handler failed {deliveries} times; last: {reason}")
            return
        delay = retry_delay(deliveries, self.settings)
        if isinstance(error, NotYet):  # an expected state that passes (a container still starting): no alarm
            log.info("not ready yet; will look again", extra={"consumer": binding.durable, "delivery": deliveries, "retry_in_s": delay, "why": str(error)})
        else:
            log.warning("handler failed; will retry", extra={"consumer": binding.durable, "delivery": deliveries, "retry_in_s": delay, "error": reason})
        await self._settle(msg.nak(delay=delay), binding, "retried")

    async def _dead_letter(self, binding: EventBinding, msg: Msg, error: str) -> None:
        meta = msg.metadata
        letter = DeadLetter.of(
            service=self.service, consumer=binding.durable, subject=msg.subject,
            sequence=meta.sequence.stream, deliveries=meta.num_delivered, error=error, raw=msg.data,
        )
        try:
            await self.publish(letter)
        except BusError:
            # Without a dead-letter record, let the server redeliver rather than lose the message.
            await self._settle(msg.nak(delay=self.settings.backoff_max_s), binding, "retried")
            return
        log.error("message dead-lettered", extra={"consumer": binding.durable, "subject": msg.subject, "error": error})
        await self._settle(msg.term(), binding, "dead_lettered")

    async def _settle(self, action: Awaitable[None], binding: EventBinding, outcome: str) -> None:
        try:
            await action
        except nats.errors.Error as error:
            # The ack is lost with the connection; the server redelivers after ack_wait.
            log.warning("could not settle message", extra={"consumer": binding.durable, "outcome": outcome, "error": repr(error)})
            return
        self.metrics.handled.labels(binding.durable, outcome).inc()

    # --- request / reply ----------------------------------------------------------------

    def _responder(self, binding: RequestBinding) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(msg: Msg) -> None:
            task = asyncio.create_task(self._answer(binding, msg))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

        return on_message

    def _broadcast_receiver(self, binding: RequestBinding) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(msg: Msg) -> None:
            task = asyncio.create_task(self._receive(binding, msg))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

        return on_message

    async def _receive(self, binding: RequestBinding, msg: Msg) -> None:
        try:
            _, payload = decode(msg.data)
            if isinstance(payload, binding.accepts):
                await binding.handler(payload)
                self.metrics.handled.labels(binding.subject, "ok").inc()
        except DecodeError:
            self.metrics.handled.labels(binding.subject, "skipped").inc()  # the stream's consumers dead-letter it
        except Exception:  # noqa: BLE001 - a failing view update must not end the subscription
            log.exception("broadcast handler failed", extra={"subject": binding.subject})
            self.metrics.handled.labels(binding.subject, "error").inc()

    async def _answer(self, binding: RequestBinding, msg: Msg) -> None:
        started = time.perf_counter()
        outcome = "ok"
        try:
            _, request = decode(msg.data)
            if not isinstance(request, binding.accepts):
                raise DecodeError(f"{binding.subject} does not take {request.event_type}")
            reply: Payload = await binding.handler(request)
        except DecodeError as error:
            reply, outcome = ErrorReply(error=str(error)), "bad_request"
        except Exception as error:  # noqa: BLE001 - the caller gets the error instead of a timeout
            log.exception("request handler failed", extra={"subject": binding.subject})
            reply, outcome = ErrorReply(error=f"{type(error).__name__}: {error}"), "error"
        self.metrics.handler_seconds.labels(binding.subject).observe(time.perf_counter() - started)
        self.metrics.handled.labels(binding.subject, outcome).inc()
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(encode(reply, self.service))

    async def request(self, request: Payload, timeout_s: float | None = None) -> Payload:
        """Send a request to its subject and return the typed reply; BusError on failure."""
        nc = self._connected()
        try:
            msg = await nc.request(request.subject(), encode(request, self.service), timeout=timeout_s or self.settings.request_timeout_s)
        except nats.errors.NoRespondersError:
            raise BusError(f"nobody answers {request.subject()}") from None
        except (nats.errors.Error, asyncio.TimeoutError) as error:
            raise BusError(f"request to {request.subject()} failed: {type(error).__name__}") from None
        _, reply = decode(msg.data)
        if isinstance(reply, ErrorReply):
            raise BusError(f"{request.subject()} answered with an error: {reply.error}")
        return reply

    # --- publishing and state -----------------------------------------------------------

    async def publish(self, event: Payload, *, expected_last_subject_seq: int | None = None) -> PubAck:
        """Publish to the stream with a de-duplication id and wait for the (cluster's) acknowledgement.

        A leader election, a lost ack or a reconnect is retried with backoff for `publish_retry_s`
        under the same `Nats-Msg-Id`, so a retry of a message the stream did store is answered as a
        duplicate instead of stored twice. BusError if it is still not stored; FencedError when
        `expected_last_subject_seq` (a fence: the subject's last stream sequence this writer knows)
        is no longer the subject's last.
        """
        js = self._jetstream()
        headers = {"Nats-Msg-Id": event.dedup_id(), "Content-Type": HEADERS_CONTENT_TYPE}
        if expected_last_subject_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_subject_seq)
        data = encode(event, self.service)
        deadline = time.monotonic() + self.settings.publish_retry_s
        delay = self.settings.backoff_base_s
        while True:
            try:
                ack = await js.publish_until(deadline, event.subject(), data, headers=headers)
                break
            except nats.js.errors.APIError as error:
                if error.err_code == WRONG_LAST_SEQUENCE:
                    self.metrics.published.labels("fenced").inc()
                    raise FencedError(f"publish to {event.subject()} fenced: {error.description}") from None
                if not is_transient(error) or time.monotonic() + delay > deadline:
                    self.metrics.published.labels("failed").inc()
                    raise BusError(f"publish to {event.subject()} failed: {type(error).__name__}: {error.description}") from None
            except (nats.errors.Error, asyncio.TimeoutError) as error:
                if time.monotonic() + delay > deadline or self._nc is None or self._nc.is_closed:
                    self.metrics.published.labels("failed").inc()
                    raise BusError(f"publish to {event.subject()} failed: {type(error).__name__}") from None
            self.metrics.published.labels("retried").inc()
            await self.healing.wait(delay)  # a new leader or the connection back: at once
            delay = min(delay * 2, 2.0)
        self.metrics.published.labels("duplicate" if ack.duplicate else "stored").inc()
        return ack

    async def kv_keys(self, bucket: str, match: str = ">") -> list[str]:
        """Keys of a provisioned bucket matching a subject pattern (`pod.>`); see `kv_keys`."""
        self.kv(bucket)
        return await kv_keys(self._jetstream(), bucket, match)

    def kv(self, bucket: str) -> KeyValue:
        """A KV bucket named at construction (provisioned on start)."""
        if bucket not in self._kv:
            raise BusError(f"KV bucket {bucket!r} was not provisioned by {self.service}")
        return self._kv[bucket]

    @property
    def jetstream(self) -> JetStreamContext:
        return self._jetstream()

    @property
    def connection(self) -> NatsClient:
        """The NATS connection itself, for a service that pipelines its own publishes; BusError before start."""
        return self._connected()

    def _connected(self) -> NatsClient:
        if self._nc is None:
            raise BusError("runtime not started")
        return self._nc

    def _jetstream(self) -> ElectionAwareJetStream:
        if self._js is None:
            raise BusError("runtime not started")
        return self._js


def connect_options(settings: BusSettings, url: str, name: str, **callbacks: Callable[..., Awaitable[None]]) -> dict[str, Any]:
    """nats.connect() options for `url` (one server or a comma-separated list) with the configured auth and TLS.

    Every entry point (services, `dev`, `events`) connects through here, so all accept the same settings.
    """
    s = settings
    options: dict[str, Any] = {
        "servers": nats_servers(url),
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 2,
        "drain_timeout": 5,
        # Without pings a server that stops answering (paused, partitioned) holds the client for minutes.
        "ping_interval": s.nats_ping_interval_s,
        "max_outstanding_pings": 2,
        "user": s.nats_user,
        "password": s.nats_password,
        "token": s.nats_token,
        **callbacks,
    }
    if s.nats_creds_file:
        options["user_credentials"] = str(s.nats_creds_file)
    if s.nats_tls_ca_file or s.nats_tls_cert_file:
        tls = ssl.create_default_context(cafile=str(s.nats_tls_ca_file) if s.nats_tls_ca_file else None)
        if s.nats_tls_cert_file and s.nats_tls_key_file:
            tls.load_cert_chain(str(s.nats_tls_cert_file), str(s.nats_tls_key_file))
        options["tls"] = tls
    return {k: v for k, v in options.items() if v is not None}


async def connect(settings: BusSettings, url: str, name: str, **callbacks: Callable[..., Awaitable[None]]) -> NatsClient:
    """A connection that reconnects for ever once made; BusError if the first one is not made in time."""
    if "error_cb" not in callbacks:
        # nats-py's default prints a traceback for every failed reconnect attempt.
        callbacks["error_cb"] = _log_client_error
    try:
        # With unlimited reconnects nats-py keeps retrying the first connection too; bound it here.
        return await asyncio.wait_for(nats.connect(**connect_options(settings, url, name, **callbacks)), settings.nats_connect_timeout_s)
    except (OSError, nats.errors.Error, asyncio.TimeoutError) as error:
        raise BusError(f"cannot reach NATS at {url} within {settings.nats_connect_timeout_s:g}s: {type(error).__name__}") from None


async def end_connection(nc: NatsClient) -> None:
    """Drain the connection, or close it where drain refuses (reconnecting through an outage), and wait
    until the client's own tasks have ended: a client left reconnecting for ever outlives its service, and
    its reconnect loop can come out of a cancel as from a failed attempt (3.11's wait_for returns a result
    that raced the cancel), so one cancel, an event loop's last included, may not end it."""
    def own() -> set[asyncio.Task[Any]]:
        tasks = [nc._reconnection_task, nc._reading_task, nc._ping_interval_task, nc._flusher_task]
        return {t for t in tasks + [sub._wait_for_msgs_task for sub in nc._subs.values()] if t is not None}

    tasks = own()
    me = asyncio.current_task()
    cancels_before = me.cancelling() if me else 0
    if not nc.is_closed:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError, OSError):
            await nc.drain()
    # nats-py's drain swallows a cancel of its caller: a stop that was cancelled must still end cancelled.
    swallowed = me is not None and me.cancelling() > cancels_before
    if not nc.is_closed:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError, OSError):
            await nc.close()
    tasks |= own()
    await cancel_all(t for t in tasks if not t.done() and t is not me)
    if swallowed:
        raise asyncio.CancelledError


def _server_of(nc: NatsClient | None) -> str:
    """The server a connection is on now (host:port), for logs."""
    url = nc.connected_url if nc is not None else None
    return url.netloc if url is not None else ""


async def _log_client_error(error: Exception) -> None:
    log.debug("NATS client error", extra={"error": repr(error)})


async def kv_keys(js: JetStreamContext, bucket: str, match: str = ">") -> list[str]:
    """Keys of `bucket` matching the subject pattern `match`, sorted, without creating a consumer.

    nats-py's `KeyValue.keys()` creates an ordered consumer that lingers on the server for five
    minutes after each call; the stream's per-subject counts answer the same question with no
    server state. Keys deleted or purged still appear (their marker is the last message), so
    callers read each key and skip the KeyNotFoundError. BusError if NATS does not answer.
    """
    prefix = f"$KV.{bucket}."
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=prefix + match)
    except (nats.errors.Error, asyncio.TimeoutError) as error:
        raise BusError(f"cannot list keys of KV bucket {bucket!r}: {type(error).__name__}") from None
    return sorted(subject[len(prefix):] for subject in (info.state.subjects or {}))


WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code for a failed `Nats-Expected-Last-*` condition (and a KV compare-and-set)."""
INSUFFICIENT_RESOURCES = 10023
"""JetStream's error code when fewer servers than the asked replicas can hold a stream."""
REPLICAS_NOT_SUPPORTED = 10074
"""... and when a single (non-clustered) server is asked for more than one replica."""
STREAM_NAME_IN_USE = 10058
NO_SUITABLE_PEERS = 10005
"""400 "no suitable peers for placement", followed by why: ", peer offline" names a server the meta leader has not
heard from lately (one restarting, or one just started that has not yet reported in), which passes."""
DUPLICATE_IN_PROCESS = 10158
"""409 "duplicate message id is in process": a retry while the first send is still being replicated (a leader
killed or partitioned mid-proposal); that first send may yet be lost with it, so this is "ask again", not "stored"."""


def is_transient(error: nats.js.errors.APIError) -> bool:
    """A JetStream API answer that means "not now" (no leader yet, cluster busy, the same id still in flight), not "never"."""
    if error.err_code == DUPLICATE_IN_PROCESS:
        return True
    return error.code in (None, 408, 500, 503) and error.err_code != INSUFFICIENT_RESOURCES


async def provision_stream(js: JetStreamContext, settings: BusSettings) -> None:
    """Create the event stream, or bring an existing one to this configuration (its replicas included)."""
    config = StreamConfig(
        name=subjects.STREAM_NAME,
        subjects=list(subjects.STREAM_SUBJECTS),
        storage=StorageType.FILE,
        max_age=settings.stream_max_age_s,
        duplicate_window=settings.duplicate_window_s,
        num_replicas=settings.nats_replicas,
    )
    await _ensure_stream(js, config, what=f"stream {subjects.STREAM_NAME}", create=lambda: js.add_stream(config))


async def provision_bucket(js: JetStreamContext, bucket: str, settings: BusSettings, history: int = 5, *,
                           bind: JetStreamContext | None = None) -> KeyValue:
    """Create a KV bucket with the configured replicas, or bring an existing bucket's replicas to it; the bucket,
    its calls going through `bind` (default: `js`).

    A bucket is a stream (`KV_<bucket>`); only its replica count is converged, the rest (history,
    TTL) stays as whoever created it chose.
    """
    config = KeyValueConfig(bucket=bucket, history=history, replicas=settings.nats_replicas)
    await _ensure_stream(js, None, what=f"KV bucket {bucket}", stream=f"KV_{bucket}", replicas=settings.nats_replicas,
                         create=lambda: js.create_key_value(config))
    return await (bind or js).key_value(bucket)


# Reads and creates retried while JetStream is unavailable or slow (a cluster electing, a server rejoining): about 25 s.
PROVISION_ATTEMPTS = 15
PROVISION_WAIT_S = sum(min(2.0, 0.25 * 2 ** attempt) for attempt in range(PROVISION_ATTEMPTS))


async def _ensure_stream(js: JetStreamContext, config: StreamConfig | None, *, what: str, create: Callable[[], Awaitable[Any]],
                         stream: str | None = None, replicas: int | None = None) -> None:
    """Create the stream, or update it so its configuration (at least its replicas) is the wanted one.

    Every replica of every service runs this at start; a race between them is settled by
    re-reading. BusError with the reason when the cluster cannot hold the replicas asked for.
    """
    name = stream or (config.name if config else "")
    wanted = replicas if replicas is not None else (config.num_replicas if config else 1)
    last_refusal: nats.js.errors.APIError | None = None
    for attempt in range(PROVISION_ATTEMPTS):
        try:
            info = await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            try:
                await create()
                return
            except nats.js.errors.APIError as error:
                if error.err_code == STREAM_NAME_IN_USE:
                    continue  # another replica created it first: read it and converge
                if isinstance(error, nats.js.errors.ServiceUnavailableError) or _peer_offline(error):
                    last_refusal = error
                    await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
                    continue  # JetStream still electing its meta leader, or a server not yet (back) in the cluster
                raise _cannot_hold(what, wanted, error) from None
            except nats.errors.TimeoutError:
                # A cluster that just formed (or is electing) may not answer in time; the create may
                # still have happened, which the next read finds.
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
                continue
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
            await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
            continue
        current = info.config
        if config is not None:
            target = config
        elif current.num_replicas == wanted:
            return
        else:
            target = current
            target.num_replicas = wanted
        if config is not None and _same_stream_config(current, config):
            return
        if current.num_replicas != wanted:
            log.info("converging replicas", extra={"what": what, "from": current.num_replicas, "to": wanted})
        try:
            await js.update_stream(target)
            return
        except nats.js.errors.APIError as error:
            if not _peer_offline(error):
                raise _cannot_hold(what, wanted, error, current.num_replicas) from None
            last_refusal = error
            await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
    if last_refusal is not None and _peer_offline(last_refusal):
        raise _cannot_hold(what, wanted, last_refusal)
    raise BusError(f"cannot provision {what}: JetStream kept timing out, being unavailable or changing it under us")


def _peer_offline(error: nats.js.errors.APIError) -> bool:
    """A placement refused only because a server is offline now: worth asking again, unlike too few servers."""
    return error.err_code == NO_SUITABLE_PEERS and "offline" in (error.description or "").lower()


def _same_stream_config(current: StreamConfig, wanted: StreamConfig) -> bool:
    return (sorted(current.subjects or []) == sorted(wanted.subjects or []) and current.num_replicas == wanted.num_replicas
            and current.max_age == wanted.max_age and current.duplicate_window == wanted.duplicate_window)


def _cannot_hold(what: str, replicas: int, error: nats.js.errors.APIError, current: int | None = None) -> BusError:
    change = f"from {current} to {replicas} replicas" if current is not None else f"with {replicas} replica(s)"
    hint = ""
    if _peer_offline(error):
        hint = (f"; a JetStream server stayed offline for about {PROVISION_WAIT_S:.0f} s and {replicas} replicas need {replicas} "
                "servers up: bring it back (or lower KAI_ISOLATOR_NATS_REPLICAS)")
    elif error.err_code in (INSUFFICIENT_RESOURCES, REPLICAS_NOT_SUPPORTED) or any(w in (error.description or "").lower() for w in ("replicas", "peers")):
        hint = (f"; KAI_ISOLATOR_NATS_REPLICAS={replicas} needs a JetStream cluster of at least {replicas} servers "
                "(set it to 1 on a single server)")
    return BusError(f"cannot provision {what} {change}: {error.description or error}{hint}")


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT while the block runs (install before announcing readiness)."""
    loop = asyncio.get_running_loop()
    received = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, received.set)
    try:
        yield received
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    with stop_signals() as received:
        await received.wait()
