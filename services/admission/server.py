"""The webhook's HTTPS server: /mutate, probes and metrics on one TLS port, certificate reload
without restart, and decisions handed to the bus through a bounded queue that never delays a response."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError, ConfigError, DecodeError
from kai_isolator.shared.events import AdmissionDecision
from kai_isolator.shared.probes import add_probe_routes
from kai_isolator.shared.settings import BusSettings, split_host_port

from .settings import MAX_BODY_BYTES, AdmissionSettings
from .webhook import DecisionRecord, Webhook, bad_request

log = logging.getLogger(__name__)

SERVICE = "admission"
OUTCOMES = ("injected", "skipped", "denied", "warned")
# The readiness-gated twin of /mutate (docs: README, "Readiness gate").
GATED_PATH = "/mutate-gated"
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class ReloadingTLS:
    """A listening TLS context whose handshakes use the newest good certificate pair.

    Reloading builds a fresh context and swaps it in from `sni_callback` (which runs for
    every handshake, SNI or not); a pair that does not load (half-written, mismatched)
    leaves the previous one serving. Loading into the live context would break it.
    """

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self._signature = self._stat()
        try:
            self.current = self._build()
            self.listening = self._build()
        except (OSError, ssl.SSLError) as error:
            raise ConfigError(f"cannot load TLS pair {cert_file} / {key_file}: {error}") from None
        self.listening.sni_callback = self._use_current

    def _build(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def _use_current(self, connection: ssl.SSLObject, _server_name: str | None, _context: ssl.SSLContext) -> None:
        connection.context = self.current

    def _stat(self) -> tuple[object, ...]:
        signature: list[object] = []
        for path in (self.cert_file, self.key_file):
            try:
                st = os.stat(path)  # follows the ..data symlink a Secret volume swaps
                signature.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                signature.append(None)
        return tuple(signature)

    def reload_if_changed(self) -> bool | None:
        """True: a new pair now serves; False: the files changed but do not load; None: unchanged."""
        signature = self._stat()
        if signature == self._signature:
            return None
        self._signature = signature
        try:
            self.current = self._build()
        except (OSError, ssl.SSLError) as error:
            log.warning("new TLS pair does not load; still serving the previous one", extra={"error": str(error)})
            return False
        log.info("TLS pair reloaded", extra={"cert": str(self.cert_file)})
        return True


class Metrics:
    def __init__(self, registry: CollectorRegistry, queue: asyncio.Queue[DecisionRecord]) -> None:
        r = registry
        decisions = Counter("kai_isolator_admission_decisions", "Admission decisions, by outcome", ["decision"], registry=r)
        self.decisions = {o: decisions.labels(o) for o in OUTCOMES}
        self.bad_requests = Counter("kai_isolator_admission_bad_requests", "Requests answered 4xx without a decision", registry=r)
        self.latency = Histogram("kai_isolator_admission_seconds", "Time to answer /mutate", buckets=LATENCY_BUCKETS, registry=r)
        self.published = Counter("kai_isolator_admission_events_published", "Decision events stored on the bus", registry=r)
        dropped = Counter("kai_isolator_admission_events_dropped", "Decision events not published, by why", ["reason"], registry=r)
        self.dropped = {k: dropped.labels(k) for k in ("queue_full", "no_bus", "publish_failed", "unroutable")}
        reloads = Counter("kai_isolator_admission_tls_reloads", "Certificate reloads, by outcome", ["outcome"], registry=r)
        self.reloads = {k: reloads.labels(k) for k in ("ok", "failed")}
        Gauge("kai_isolator_admission_event_queue", "Decision events waiting for the bus", registry=r).set_function(queue.qsize)


class DecisionPublisher:
    """Takes decisions without ever waiting; workers publish them once the bus is up."""

    def __init__(self, runtime: Runtime | None, metrics: Metrics, queue: asyncio.Queue[DecisionRecord], workers: int) -> None:
        self._runtime = runtime
        self._metrics = metrics
        self._queue = queue
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []
        self.bus_ready = asyncio.Event()

    @property
    def pending(self) -> int:
        """Decisions waiting for the bus."""
        return self._queue.qsize()

    def offer(self, record: DecisionRecord) -> None:
        if self._runtime is None:
            self._metrics.dropped["no_bus"].inc()
            return
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self._metrics.dropped["queue_full"].inc()

    def start(self) -> None:
        if self._runtime is not None:
            self._tasks = [asyncio.create_task(self._work(), name=f"admission-publisher-{i}") for i in range(self._workers)]

    async def stop(self, grace_s: float = 2.0) -> None:
        """Publish what is queued for a moment if the bus is up, then give the rest up as dropped."""
        if self.bus_ready.is_set():
            deadline = time.monotonic() + grace_s
            while not self._queue.empty() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        for task in self._tasks:
            # Cancel until done: asyncio.wait_for inside the NATS client can swallow one cancellation.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
        while not self._queue.empty():
            self._queue.get_nowait()
            self._metrics.dropped["publish_failed"].inc()

    async def _work(self) -> None:
        assert self._runtime is not None
        await self.bus_ready.wait()
        while True:
            record = await self._queue.get()
            await self._publish(self._runtime, record)

    async def _publish(self, runtime: Runtime, record: DecisionRecord) -> None:
        try:
            event = AdmissionDecision(
                request_uid=record.request_uid, namespace=record.namespace, pod_name=record.pod_name,
                decision=record.decision, reason=record.reason, container=record.container,
                findings=list(record.findings), patch_operations=record.patch_operations,
            )
            await runtime.publish(event)
        except DecodeError:
            self._metrics.dropped["unroutable"].inc()  # no namespace a subject can carry
        except BusError:
            self._metrics.dropped["publish_failed"].inc()
        else:
            self._metrics.published.inc()


class AdmissionServer:
    """The running webhook: HTTPS site, certificate watcher, and (when a bus URL is given) the publisher."""

    def __init__(self, settings: AdmissionSettings, bus: BusSettings | None = None) -> None:
        self.settings = settings
        self.webhook = Webhook.from_settings(settings)
        # Called by a second webhook entry whose namespaceSelector picks namespaces labelled
        # kai-resource-isolator.io/readiness-gate=true (the request itself carries no namespace labels).
        self.gated_webhook = Webhook.from_settings(settings, readiness_gate=True)
        self.runtime = Runtime(SERVICE, bus) if bus is not None and bus.nats_url else None
        registry = self.runtime.metrics.registry if self.runtime else CollectorRegistry()
        queue: asyncio.Queue[DecisionRecord] = asyncio.Queue(settings.event_queue_size)
        self.metrics = Metrics(registry, queue)
        self.publisher = DecisionPublisher(self.runtime, self.metrics, queue, settings.publish_concurrency)
        self.tls: ReloadingTLS | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._serving = False
        self.url = ""
        self.registry = registry

    def not_ready(self) -> list[str]:
        return [] if self._serving else ["not serving"]

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/mutate", self.mutate)
        app.router.add_route("*", GATED_PATH, self.mutate)
        add_probe_routes(app, self.registry, self.not_ready)
        return app

    async def start(self) -> None:
        host, port = split_host_port(self.settings.listen)
        self.tls = ReloadingTLS(self.settings.tls_cert_file, self.settings.tls_private_key_file)
        self._runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self.tls.listening, backlog=1024)
        try:
            await site.start()
        except OSError as error:
            await self._runner.cleanup()
            raise ConfigError(f"cannot listen on {self.settings.listen}: {error}") from None
        bound_host, bound_port = self._runner.addresses[0][:2]
        self.url = f"https://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
        self._serving = True
        self.publisher.start()
        self._tasks.append(asyncio.create_task(self._watch_tls(), name="admission-tls-watch"))
        if self.runtime is not None:
            self._tasks.append(asyncio.create_task(self._connect_bus(), name="admission-bus-connect"))
        log.info("admission webhook serving", extra={"url": self.url, "policy": self.settings.policy, "bus": bool(self.runtime)})

    async def stop(self) -> None:
        self._serving = False
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
        await self.publisher.stop()
        if self.runtime is not None:
            await self.runtime.stop()

    async def _watch_tls(self) -> None:
        assert self.tls is not None
        while True:
            await asyncio.sleep(self.settings.tls_reload_interval_s)
            changed = self.tls.reload_if_changed()
            if changed is not None:
                self.metrics.reloads["ok" if changed else "failed"].inc()

    async def _connect_bus(self) -> None:
        """Connect in the background, retrying forever: the webhook answers meanwhile."""
        assert self.runtime is not None
        url = self.runtime.settings.nats_url or ""
        while True:
            try:
                await self.runtime.start(url)
            except BusError as error:
                log.warning("bus unreachable; decisions are dropped until it is", extra={"error": str(error)})
                await asyncio.sleep(1.0)
                continue
            self.publisher.bus_ready.set()
            return

    async def mutate(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        if request.method != "POST":
            self.metrics.bad_requests.inc()
            return web.Response(status=405, text="method not allowed: POST an AdmissionReview\n", headers={"Allow": "POST"})
        if request.content_type != "application/json":
            answer = bad_request(f"content type must be application/json, got {request.content_type or 'none'}")
        elif (request.content_length or 0) > MAX_BODY_BYTES:
            answer = bad_request(f"body of {request.content_length} bytes is over the {MAX_BODY_BYTES} byte limit")
        else:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                answer = bad_request(f"body is over the {MAX_BODY_BYTES} byte limit")
            else:
                answer = (self.gated_webhook if request.path == GATED_PATH else self.webhook).handle(raw)
        record = answer.record
        if record is None:
            self.metrics.bad_requests.inc()
        else:
            self.metrics.decisions[record.decision].inc()
            self.publisher.offer(record)
            # Denials and warnings are rare and worth a line; every decision only when debugging.
            if record.decision in ("denied", "warned") or log.isEnabledFor(logging.DEBUG):
                log.log(logging.INFO if record.decision in ("denied", "warned") else logging.DEBUG, "admission decision", extra={
                    "uid": record.request_uid, "namespace": record.namespace, "pod": record.pod_name,
                    "decision": record.decision, "reason": record.reason,
                })
        self.metrics.latency.observe(time.perf_counter() - started)
        return web.Response(status=answer.status, body=answer.body, content_type=answer.content_type)
