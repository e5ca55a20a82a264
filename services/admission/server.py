"""The webhook's HTTPS server: /mutate, probes and metrics on one TLS port, certificate reload
without restart, and decisions handed to the bus through a bounded buffer that never delays a response."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import os
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError, ConfigError
from kai_isolator.shared.probes import add_probe_routes
from kai_isolator.shared.settings import BusSettings, split_host_port
from kai_isolator.shared.tasks import cancel_all

from .publisher import DecisionPublisher, PublishCounters
from .settings import MAX_BODY_BYTES, AdmissionSettings
from .webhook import Webhook, bad_request

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


class RequestMetrics(Collector):
    """Decisions, bad requests and answer latency as plain numbers, exported at scrape time: a
    prometheus Counter or Histogram takes a lock and a few calls per update, per request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = dict.fromkeys(OUTCOMES, 0)
        self.bad_requests = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bound
        self.latency_sum = 0.0
        registry.register(self)

    def observe(self, seconds: float) -> None:
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("kai_isolator_admission_decisions", "Admission decisions, by outcome", labels=["decision"])
        for outcome, count in self.decisions.items():
            decisions.add_metric([outcome], count)
        yield decisions
        yield CounterMetricFamily("kai_isolator_admission_bad_requests", "Requests answered 4xx without a decision", value=self.bad_requests)
        cumulative = list(itertools.accumulate(self.latency_counts))
        buckets = [(repr(bound), count) for bound, count in zip(LATENCY_BUCKETS, cumulative)] + [("+Inf", cumulative[-1])]
        yield HistogramMetricFamily("kai_isolator_admission_seconds", "Time to answer /mutate", buckets=buckets, sum_value=self.latency_sum)


class Metrics:
    def __init__(self, registry: CollectorRegistry, pending: Callable[[], int]) -> None:
        r = registry
        self.requests = RequestMetrics(r)
        published = Counter("kai_isolator_admission_events_published", "Decision events stored on the bus", registry=r)
        dropped = Counter("kai_isolator_admission_events_dropped", "Decision events not published, by why", ["reason"], registry=r)
        self.publishing = PublishCounters(published, {k: dropped.labels(k) for k in ("queue_full", "no_bus", "publish_failed", "unroutable")})
        reloads = Counter("kai_isolator_admission_tls_reloads", "Certificate reloads, by outcome", ["outcome"], registry=r)
        self.reloads = {k: reloads.labels(k) for k in ("ok", "failed")}
        Gauge("kai_isolator_admission_event_queue", "Decision events waiting for the bus", registry=r).set_function(pending)


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
        self.metrics = Metrics(registry, lambda: self.publisher.pending)
        self.publisher = DecisionPublisher(self.runtime, self.metrics.publishing, settings.event_queue_size, settings.publish_concurrency)
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
        await cancel_all(self._tasks)
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
            self.metrics.requests.bad_requests += 1
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
        metrics = self.metrics.requests
        if record is None:
            metrics.bad_requests += 1
        else:
            metrics.decisions[record.decision] += 1
            if record.published and not record.dry_run:
                self.publisher.offer(record)
            # Denials and warnings are rare and worth a line; every decision only when debugging.
            if record.decision in ("denied", "warned") or log.isEnabledFor(logging.DEBUG):
                log.log(logging.INFO if record.decision in ("denied", "warned") else logging.DEBUG, "admission decision", extra={
                    "uid": record.request_uid, "namespace": record.namespace, "pod": record.pod_name,
                    "decision": record.decision, "reason": record.reason,
                })
        metrics.observe(time.perf_counter() - started)
        return web.Response(status=answer.status, body=answer.body, content_type=answer.content_type)
