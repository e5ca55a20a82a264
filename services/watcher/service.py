"""The pod watcher: list + watch pods with kubernetes-asyncio and publish each GPU-sharing pod's story on the bus.

Restart-safe: the resume resourceVersion and every pod's published states live in KV
buckets. Nothing is lost: when NATS is away the watcher stops reading the watch (the API
server keeps the history) and retries; on 410 Gone it relists and reconciles, deletions
included. Nothing is duplicated for a durable consumer: stored states are never
re-published, and a re-publication after a crash carries the same `Nats-Msg-Id`.

Replicated active/standby: one watcher per scope holds a KV lease and works, the others wait
to take over. Fenced: every record write is a compare-and-set on its KV revision and every
publish names the subject's last stream sequence it knows, so a leader paused past its lease
is refused by the server instead of repeating or reordering a pod's story.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import nats.errors
import nats.js.errors
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException
from prometheus_client import Counter, Gauge

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError, ConfigError, FencedError, LeaseLostError
from kai_isolator.shared.events import PodIsolation
from kai_isolator.shared.lease import Lease

from .settings import WatcherSettings
from .story import PodRecord, PodView, advance, deletion, needs_limit, view_of

log = logging.getLogger(__name__)
T = TypeVar("T")
RESUME_KEY_PREFIX = "resume"


class _Stopping(Exception):
    """Stop was asked while waiting for the bus; what is unpublished is replayed after restart."""


class _Metrics:
    def __init__(self, runtime: Runtime) -> None:
        r = runtime.metrics.registry
        self.changes = Counter("kai_isolator_watcher_pod_changes", "Watch events read, by type", ["type"], registry=r)
        self.published = Counter("kai_isolator_watcher_events", "Isolation events published, by state", ["state"], registry=r)
        self.relists = Counter("kai_isolator_watcher_relists", "Full relists (start, 410 Gone)", registry=r)
        self.retries = Counter("kai_isolator_watcher_retries", "Waits after an API or bus failure, by cause", ["cause"], registry=r)
        self.tracked = Gauge("kai_isolator_watcher_tracked_pods", "GPU-sharing pods with a stored record", registry=r)
        self.synced = Gauge("kai_isolator_watcher_synced", "1 once the first list has been reconciled", registry=r)
        self.leader = Gauge("kai_isolator_watcher_leader", "1 while this replica holds the watch lease (0: standby)", registry=r)
        self.step_downs = Counter("kai_isolator_watcher_step_downs", "Lease lost or a fenced write refused: state dropped, standby again", registry=r)


async def api_client(settings: WatcherSettings) -> client.ApiClient:
    """An ApiClient from the kubeconfig, in-cluster config, or ~/.kube/config, in that order."""
    configuration = client.Configuration()
    try:
        if settings.kubeconfig:
            await config.load_kube_config(config_file=str(settings.kubeconfig), client_configuration=configuration, persist_config=False)
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except ConfigException:
                await config.load_kube_config(client_configuration=configuration, persist_config=False)
    except (ConfigException, OSError) as error:
        raise ConfigError(f"cannot load Kubernetes client configuration: {error}") from None
    return client.ApiClient(configuration)


class PodWatcher:
    """One watcher scope (all pods, or one node's) bound to a started Runtime with its KV buckets."""

    def __init__(self, runtime: Runtime, settings: WatcherSettings, api: client.ApiClient, lease: Lease) -> None:
        self.runtime = runtime
        self.settings = settings
        self.core = client.CoreV1Api(api)
        self.metrics = _Metrics(runtime)
        self.records: dict[str, PodRecord] = {}
        self.resource_version: str | None = None
        self._saved_version: str | None = None
        self._unsaved = 0
        self._saved_at = time.monotonic()
        self._limits: dict[tuple[str, str, str], str] = {}
        self._stopping = asyncio.Event()
        self._loaded = False
        self.synced = asyncio.Event()
        self.lease = lease
        self.leading = asyncio.Event()
        self._revisions: dict[str, int] = {}
        """KV revision of each pod record as we last wrote or read it: the compare-and-set fence."""
        self._tips: dict[str, tuple[int, str | None]] = {}
        """subject -> (last stream sequence, its event id) as this leader knows it: the publish fence."""
        # A standby can work (it takes over on its own), so it is ready; a leader once it has listed.
        runtime.add_readiness_check(lambda: None if self.synced.is_set() or not self.leading.is_set() else "first pod list not reconciled yet")

    # --- keys ---------------------------------------------------------------------------

    @property
    def _resume_key(self) -> str:
        return f"{RESUME_KEY_PREFIX}.{self.settings.scope}"

    def _record_key(self, uid: str) -> str:
        return f"{self.settings.scope}.{uid}"

    # --- the loop -----------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """Load state, then list/watch until `stop()`; API and bus failures back off and retry, never end it."""
        main = asyncio.create_task(self._serve(), name="pod-watcher")
        stop = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Cancelled from outside is an abrupt end, like a crash: KV already holds all that counts.
            # The flag too, because a client timeout racing the cancel may swallow it inside aiohttp.
            self._stopping.set()
            for task in (main, stop):
                task.cancel()
            await asyncio.gather(main, stop, return_exceptions=True)
            raise
        for task in (main, stop):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, _Stopping):
            await stop
            await main  # re-raises a bug; a cancelled event is simply replayed after restart
        # resource_version only ever names fully handled changes, so it is safe to save here.
        with contextlib.suppress(BusError, LeaseLostError, nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            if self.lease.held():
                await asyncio.wait_for(self._save_resume(force=True), self.runtime.settings.request_timeout_s)
        await self.lease.release()  # a standby takes over at once instead of after the ttl

    async def _serve(self) -> None:
        """Stand by until the lease is ours, lead until it is lost (or a fenced write says so), repeat."""
        while not self._stopping.is_set():
            if not await self.lease.acquire(self._stopping):
                return
            self.leading.set()
            self.metrics.leader.set(1)
            keeper = asyncio.create_task(self.lease.keep(), name="watch-lease")
            lead = asyncio.create_task(self._main(), name="watch-lead")
            lost = asyncio.create_task(self.lease.lost.wait())
            try:
                await asyncio.wait({lead, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (keeper, lead, lost):
                    task.cancel()
                results = await asyncio.gather(keeper, lead, lost, return_exceptions=True)
            error = results[1]
            if isinstance(error, BaseException) and not isinstance(error, (LeaseLostError, asyncio.CancelledError)):
                raise error
            if self._stopping.is_set():
                return
            self._step_down(str(error) if isinstance(error, LeaseLostError) else "lease lost")

    def _step_down(self, why: str) -> None:
        """Forget all in-memory state: the next term starts from KV, as a fresh process would."""
        log.warning("watcher stepping down to standby", extra={"scope": self.settings.scope, "why": why})
        self.metrics.step_downs.inc()
        self.metrics.leader.set(0)
        self.metrics.synced.set(0)
        self.leading.clear()
        self.synced.clear()
        self.records.clear()
        self._revisions.clear()
        self._tips.clear()
        self._limits.clear()
        self.resource_version = self._saved_version = None
        self._unsaved = 0
        self._loaded = False
        self.lease.token = None

    async def _main(self) -> None:
        await self._retrying("bus", self._load_state)
        await self._retrying("bus", self._recover)
        self._loaded = True
        await self._loop()

    async def _loop(self) -> None:
        delay = self.settings.backoff_base_s
        while not self._stopping.is_set():
            try:
                if self.resource_version is None:
                    await self._relist()
                await self._watch()
                delay = self.settings.backoff_base_s
            except ApiException as error:
                if error.status == 410:
                    log.info("resume version expired (410 Gone); relisting", extra={"resource_version": self.resource_version})
                    self.resource_version = None
                    continue
                delay = await self._pause("api", delay, f"API error {error.status}: {error.reason}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                delay = await self._pause("api", delay, f"{type(error).__name__}: {error}")

    async def _pause(self, cause: str, delay: float, why: str) -> float:
        self.metrics.retries.labels(cause).inc()
        log.warning("Kubernetes API unavailable; retrying", extra={"error": why, "retry_in_s": delay})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)
        return min(delay * 2, self.settings.backoff_max_s)

    def _list_kwargs(self) -> dict[str, Any]:
        return {"field_selector": f"spec.nodeName={self.settings.node}"} if self.settings.node else {}

    async def _relist(self) -> None:
        """List every pod, publish what changed against the stored records, and close the stories of pods now gone."""
        self.metrics.relists.inc()
        timeout = aiohttp.ClientTimeout(sock_connect=self.settings.connect_timeout_s, total=self.settings.list_timeout_s)
        response = await self.core.list_pod_for_all_namespaces(_preload_content=False, _request_timeout=timeout, **self._list_kwargs())
        try:
            body = await response.read()
        finally:
            response.release()
        if response.status >= 400:
            raise ApiException(status=response.status, reason=_status_message(body))
        listing = json.loads(body)
        version = str(listing["metadata"]["resourceVersion"])
        present = set()
        for pod in listing.get("items") or []:
            view = view_of(pod)
            if view is not None:
                present.add(view.uid)
                await self._observe(view)
        for uid in [u for u in self.records if u not in present]:
            if _closed(self.records[uid]):
                await self._retrying("bus", self._drop_record, self.records[uid])
            else:
                await self._close(self.records[uid], version)
        self.resource_version = version
        await self._retrying("bus", self._save_resume, force=True)
        log.info("pods listed and reconciled", extra={"resource_version": version, "tracked": len(self.records)})

    async def _watch(self) -> None:
        s = self.settings
        self.synced.set()  # listed now, or resuming from a version whose state KV holds
        self.metrics.synced.set(1)
        timeout = aiohttp.ClientTimeout(sock_connect=s.connect_timeout_s, sock_read=s.read_timeout_s)
        async with watch.Watch(return_type="object") as stream:
            async for event in stream.stream(
                self.core.list_pod_for_all_namespaces, resource_version=self.resource_version, allow_watch_bookmarks=True,
                timeout_seconds=s.watch_timeout_s, _request_timeout=timeout, **self._list_kwargs(),
            ):
                if self._stopping.is_set():
                    return
                if not isinstance(event, dict):
                    raise ApiException(status=0, reason=f"unreadable watch line: {str(event)[:200]}")
                kind = event.get("type")
                self.metrics.changes.labels(str(kind)).inc()
                pod = event.get("raw_object") or {}
                if kind in ("ADDED", "MODIFIED"):
                    view = view_of(pod)
                    if view is not None:
                        await self._observe(view)
                elif kind == "DELETED":
                    view = view_of(pod)
                    if view is not None:
                        await self._observe(view)
                    # By uid: a pod whose GPU annotations were removed before deletion still ends its story.
                    uid = str((pod.get("metadata") or {}).get("uid") or "")
                    if uid in self.records and not _closed(self.records[uid]):
                        await self._close(self.records[uid], str((pod.get("metadata") or {}).get("resourceVersion") or ""))
                version = str((pod.get("metadata") or {}).get("resourceVersion") or "")
                if version:
                    self.resource_version = version
                    self._unsaved += 1
                    await self._retrying("bus", self._save_resume, force=kind == "BOOKMARK")

    # --- one pod ------------------------------------------------------------------------

    async def _observe(self, view: PodView) -> None:
        record = self.records.get(view.uid)
        if record is not None and _closed(record):
            return  # a replay (after a takeover or crash) of a pod whose story is already closed
        limit = await self._expected_limit(view) if needs_limit(view, record) else None
        events, updated = advance(view, record, limit)
        if not events:
            return
        # Write-ahead: the record names the events before they go out, so a crash in between
        # republishes exactly these (same Nats-Msg-Id) instead of deriving new ones.
        await self._retrying("bus", self._put_record, updated)
        for event in events:
            await self._retrying("bus", self._publish, event)

    async def _close(self, record: PodRecord, version: str) -> None:
        self._limits = {key: value for key, value in self._limits.items() if key[0] != record.uid}
        event = deletion(record, version)
        closing = record.model_copy(update={"pending": [event]})
        await self._retrying("bus", self._put_record, closing)
        await self._retrying("bus", self._publish, event)
        await self._retrying("bus", self._put_record, _tombstone(closing))

    async def _recover(self) -> None:
        """Finish what a crash interrupted: publish each record's pending events the stream does not have yet."""
        js = self.runtime.jetstream
        for record in [r for r in self.records.values() if r.pending]:
            subject = record.pending[0].subject()
            try:
                last = await js.get_last_msg(subjects.STREAM_NAME, subject)
                last_id = json.loads(last.data or b"{}").get("id")
            except nats.js.errors.NotFoundError:
                last_id = None
            ids = [e.dedup_id() for e in record.pending]
            unsent = record.pending[ids.index(last_id) + 1:] if last_id in ids else record.pending
            for event in unsent:
                await self._publish(event)
            if unsent:
                log.info("republished events interrupted by a crash", extra={"pod": f"{record.namespace}/{record.name}", "events": len(unsent)})
            if any(e.state == "deleted" for e in record.pending):
                await self._put_record(_tombstone(record))

    async def _expected_limit(self, view: PodView) -> str | None:
        """Read the limit KAI granted: a literal env value, or the ConfigMap key its binder wrote."""
        source = view.limit
        if source is None:
            return None
        if source.literal is not None:
            return source.literal
        # Per pod: a recreated pod may reuse the ConfigMap name with another limit.
        key = (view.uid, source.configmap or "", source.key)
        if key in self._limits:
            return self._limits[key]
        try:
            response = await self.core.read_namespaced_config_map(
                source.configmap, view.namespace, _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(sock_connect=self.settings.connect_timeout_s, total=self.settings.list_timeout_s),
            )
            try:
                body = await response.read()
            finally:
                response.release()
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            log.warning("cannot read the limit ConfigMap", extra={"pod": f"{view.namespace}/{view.name}", "error": repr(error)})
            return None
        if response.status != 200:
            return None  # not written (yet): KAI leaves the limit unset when its calculation fails
        value = (json.loads(body).get("data") or {}).get(source.key)
        if value is not None:
            self._limits[key] = value
        return value

    # --- the bus ------------------------------------------------------------------------

    async def _tip(self, subject: str) -> tuple[int, str | None]:
        """The subject's last stream sequence and event id: known, or read from the stream."""
        if subject not in self._tips:
            try:
                last = await self.runtime.jetstream.get_last_msg(subjects.STREAM_NAME, subject)
                self._tips[subject] = (last.seq or 0, json.loads(last.data or b"{}").get("id"))
            except nats.js.errors.NotFoundError:
                self._tips[subject] = (0, None)
        return self._tips[subject]

    async def _publish(self, event: PodIsolation) -> None:
        """Publish unless the subject already ends with this event; fenced on the subject's last sequence."""
        subject, event_id = event.subject(), event.dedup_id()
        seq, last_id = await self._tip(subject)
        if last_id == event_id:
            return  # a previous holder (or our own lost ack) already stored it
        self.lease.check()
        try:
            ack = await self.runtime.publish(event, expected_last_subject_seq=seq)
        except FencedError:
            # Someone else wrote this pod's subject since we looked: only fine if it is this very event.
            self._tips.pop(subject, None)
            if (await self._tip(subject))[1] == event_id:
                return
            raise LeaseLostError(f"{subject} was written by another watcher; resynchronising from KV") from None
        if ack.duplicate:
            self._tips.pop(subject, None)  # the sequence is the original's, not necessarily the tip
        else:
            self._tips[subject] = (ack.seq, event_id)
        self.metrics.published.labels(event.state).inc()

    async def _put_record(self, record: PodRecord) -> None:
        self.lease.check()
        kv, key = self.runtime.kv(self.settings.state_bucket), self._record_key(record.uid)
        value = record.model_dump_json().encode()
        try:
            if record.uid in self._revisions:
                revision = await kv.update(key, value, last=self._revisions[record.uid])
            else:
                revision = await kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise LeaseLostError(f"pod record {key} was written by another watcher; resynchronising from KV") from None
        self._revisions[record.uid] = revision
        self.records[record.uid] = record
        self.metrics.tracked.set(len(self.records))

    async def _drop_record(self, record: PodRecord) -> None:
        self.lease.check()
        key = self._record_key(record.uid)
        try:
            await self.runtime.kv(self.settings.state_bucket).delete(key, last=self._revisions.get(record.uid))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise LeaseLostError(f"pod record {key} was written by another watcher; resynchronising from KV") from None
        self._revisions.pop(record.uid, None)
        self.records.pop(record.uid, None)
        self.metrics.tracked.set(len(self.records))

    async def _save_resume(self, force: bool = False) -> None:
        if not self._loaded or self.resource_version is None or self.resource_version == self._saved_version:
            return
        due = self._unsaved >= self.settings.resume_save_every or time.monotonic() - self._saved_at >= self.settings.resume_save_interval_s
        if not (force or due):
            return
        self.lease.check()
        await self.runtime.kv(self.settings.resume_bucket).put(self._resume_key, self.resource_version.encode())
        self._saved_version, self._unsaved, self._saved_at = self.resource_version, 0, time.monotonic()
        # No replay can start before the saved version any more: closed stories older than it can go.
        for record in [r for r in self.records.values() if _closed(r) and _not_after(r.resource_version, self._saved_version)]:
            await self._drop_record(record)

    async def _load_state(self) -> None:
        """Read the resume version and every pod record of this scope back from KV."""
        try:
            entry = await self.runtime.kv(self.settings.resume_bucket).get(self._resume_key)
            self.resource_version = self._saved_version = entry.value.decode() if entry.value else None
        except nats.js.errors.KeyNotFoundError:
            self.resource_version = None
        watcher = await self.runtime.kv(self.settings.state_bucket).watch(f"{self.settings.scope}.>", ignore_deletes=True)
        try:
            while True:
                entry = await watcher.updates(timeout=self.runtime.settings.request_timeout_s)
                if entry is None:
                    break
                if entry.value:
                    record = PodRecord.model_validate_json(entry.value)
                    self.records[record.uid] = record
                    self._revisions[record.uid] = entry.revision or 0
                if entry.delta == 0:
                    break
        finally:
            await watcher.stop()
        self.metrics.tracked.set(len(self.records))
        log.info("watcher state loaded", extra={"scope": self.settings.scope, "resume": self.resource_version, "tracked": len(self.records)})

    async def _retrying(self, cause: str, action: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run a bus action until it succeeds. Meanwhile the watch is not read: that is the backpressure."""
        delay = self.settings.backoff_base_s
        while True:
            try:
                return await action(*args, **kwargs)
            except (BusError, nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as error:
                self.lease.check()  # a leader that cannot renew through the outage stops acting when its term ends
                if self._stopping.is_set():
                    log.warning("bus unavailable while stopping; unsaved changes replay after restart", extra={"error": repr(error)})
                    raise _Stopping from None
                self.metrics.retries.labels(cause).inc()
                log.warning("bus unavailable; holding the watch until it returns", extra={"error": f"{type(error).__name__}: {error}", "retry_in_s": delay})
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.backoff_max_s)


def _closed(record: PodRecord) -> bool:
    """A tombstone: the pod's `deleted` event is out; kept until no replay can reach back before it."""
    return "deleted" in record.emitted and not record.pending


def _tombstone(record: PodRecord) -> PodRecord:
    deleted = [e for e in record.pending if e.state == "deleted"]
    version = deleted[-1].resource_version if deleted else record.resource_version
    return record.model_copy(update={"pending": [], "emitted": [*record.emitted, "deleted"], "resource_version": version})


def _not_after(version: str, saved: str) -> bool:
    """resourceVersions are opaque; etcd's are integers, and anything else is simply kept until a relist."""
    try:
        return int(version) <= int(saved)
    except ValueError:
        return False


def _status_message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message", ""))
    except ValueError:
        return body[:200].decode(errors="replace")
