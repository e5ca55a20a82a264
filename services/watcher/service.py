"""The pod watcher: list + watch pods and publish each GPU-sharing pod's story on the bus, many pods at a time.

Restart-safe: the resume resourceVersion and every pod's published states live in KV
buckets. Nothing is lost: when NATS is away the lanes stop, the watch is no longer read
(the API server keeps the history) and they retry; on 410 Gone it relists and reconciles,
deletions included. Nothing is duplicated for a durable consumer: stored states are never
re-published, and a re-publication after a crash carries the same `Nats-Msg-Id`.

Pipelined: changes go to ordered lanes keyed by the pod (its subject), so one pod's write-ahead
record and events stay in order while other pods' round trips overlap; the resume point only
ever names a version up to which every change was fully handled.

Replicated active/standby: one watcher per scope holds a KV lease and works, the others wait
to take over. Fenced: every record write is a compare-and-set on its KV revision (records.py) and
every publish names the subject's last stream sequence it knows (fenced.py), so a leader paused past
its lease is refused by the server instead of repeating or reordering a pod's story.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import nats.errors
import nats.js.errors
from prometheus_client import Counter, Gauge

from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError, LeaseLostError
from kai_isolator.shared.failover import ASK_AGAIN_AFTER_S
from kai_isolator.shared.lease import Lease
from kai_isolator.shared.tasks import cancel_all

from .acks import AckPipeline
from .fenced import FencedPublisher
from .kube import KubeApiError, KubeClient
from .lanes import Lanes, Progress
from .records import PodRecords, closed, tombstone
from .settings import WatcherSettings
from .story import PodRecord, PodView, advance, deletion, needs_limit, view_of

log = logging.getLogger(__name__)
T = TypeVar("T")
RESUME_KEY_PREFIX = "resume"
RELIST_KEY_PREFIX = "relisting"
PODS_PATH = "/api/v1/pods"


class _Stopping(Exception):
    """Stop was asked while waiting for the bus; what is unpublished is replayed after restart."""


class _Gone(Exception):
    """The watch's version is older than the API server keeps (410): relist."""


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
        self.in_flight = Gauge("kai_isolator_watcher_in_flight", "Changes read but not yet fully handled", registry=r)
        # Children resolved once: a labels() lookup per event is a measurable share of the hot path.
        self._changes: dict[str, Any] = {}
        self._published: dict[str, Any] = {}

    def changed(self, kind: str) -> None:
        child = self._changes.get(kind)
        if child is None:
            child = self._changes[kind] = self.changes.labels(kind)
        child.inc()

    def emitted(self, state: str) -> None:
        child = self._published.get(state)
        if child is None:
            child = self._published[state] = self.published.labels(state)
        child.inc()


class PodWatcher:
    """One watcher scope (all pods, or one node's) bound to a started Runtime with its KV buckets."""

    def __init__(self, runtime: Runtime, settings: WatcherSettings, api: KubeClient, lease: Lease) -> None:
        self.runtime = runtime
        self.settings = settings
        self.api = api
        self.metrics = _Metrics(runtime)
        self.records = PodRecords(runtime, settings, lease)
        self.stream = FencedPublisher(runtime, lease, self.metrics.emitted)
        self.resource_version: str | None = None
        """The resume point: every change up to it is fully handled (saved to KV now and then)."""
        self._read_version: str | None = None
        """The last version read from the API: where a re-watch continues while the lanes work on."""
        self._saved_version: str | None = None
        self._relist_at: str | None = None
        """The version of a relist a crash interrupted: listed again at exactly that version, then watched from it."""
        self._saved_at = time.monotonic()
        self._limits: dict[str, dict[tuple[str, str], str]] = {}
        """pod uid -> (ConfigMap, key) -> the limit read from it."""
        self._stopping = asyncio.Event()
        self._loaded = False
        self.synced = asyncio.Event()
        self.lease = lease
        self.leading = asyncio.Event()
        self._progress = Progress(settings.max_in_flight)
        self._lanes = Lanes(settings.lanes, self._progress)
        self._acks: AckPipeline | None = None
        self._state = asyncio.Lock()
        """Held by a relist and a resume save: both walk the records the other would drop."""
        # A standby can work (it takes over on its own), so it is ready; a leader once it has listed.
        runtime.add_readiness_check(lambda: None if self.synced.is_set() or not self.leading.is_set() else "first pod list not reconciled yet")

    # --- keys ---------------------------------------------------------------------------

    @property
    def _resume_key(self) -> str:
        return f"{RESUME_KEY_PREFIX}.{self.settings.scope}"

    @property
    def _relist_key(self) -> str:
        return f"{RELIST_KEY_PREFIX}.{self.settings.scope}"

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
            await cancel_all((main, stop))
            raise
        # Cancelled again until it ends: a cancel swallowed inside aiohttp would leave the watch waiting for its next
        # event (a bookmark comes about once a minute), and a graceful stop waiting with it.
        await cancel_all((main, stop))
        with contextlib.suppress(asyncio.CancelledError, _Stopping):
            main.result()  # re-raises a bug; a cancelled event is simply replayed after restart
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
            error = _unwrapped(results[1])
            if isinstance(error, BaseException) and not isinstance(error, (LeaseLostError, asyncio.CancelledError, _Stopping)):
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
        self.records.forget_all()
        self.stream.forget_all()
        self._limits.clear()
        self.resource_version = self._saved_version = self._read_version = self._relist_at = None
        self._loaded = False
        self.lease.token = None

    async def _main(self) -> None:
        self._progress = Progress(self.settings.max_in_flight)
        self._lanes = Lanes(self.settings.lanes, self._progress)
        self._acks = AckPipeline(self.runtime.connection, self.runtime.settings.jetstream_timeout_s, limit=4 * self.settings.lanes)
        self.records.acks = self.stream.acks = self._acks
        await self._retrying("bus", self._acks.start)
        acks = self._acks
        forget_acks = self.runtime.on_disconnected(acks.resend)
        # A new stream leader may never have seen what awaits its ack: send it again now, not after the ack timeout.
        forget_leaders = self.runtime.on_healed(lambda: acks.resend(ASK_AGAIN_AFTER_S))
        try:
            await self._retrying("bus", self._load_state)
            await self._retrying("bus", self._recover)
            self._loaded = True
            # One group: a lane's failure (a fenced write, a bug) ends the reading and the saving too.
            async with asyncio.TaskGroup() as group:
                group.create_task(self._lanes.run(), name="watch-lanes")
                group.create_task(self._saver(), name="watch-resume-saver")
                group.create_task(self._loop(), name="watch-read")
        finally:
            forget_acks()
            forget_leaders()
            await self._acks.stop()

    async def _loop(self) -> None:
        delay = self.settings.backoff_base_s
        while not self._stopping.is_set():
            try:
                if self._read_version is None:
                    await self._relist()
                await self._watch()
                delay = self.settings.backoff_base_s
            except _Gone:
                log.info("resume version expired (410 Gone); relisting", extra={"resource_version": self._read_version})
                await self._progress.drained()
                self._read_version = None
            except KubeApiError as error:
                delay = await self._pause("api", delay, f"API error {error.status}: {error.reason}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                delay = await self._pause("api", delay, f"{type(error).__name__}: {error}")
        raise _Stopping

    async def _pause(self, cause: str, delay: float, why: str) -> float:
        self.metrics.retries.labels(cause).inc()
        log.warning("Kubernetes API unavailable; retrying", extra={"error": why, "retry_in_s": delay})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)
        return min(delay * 2, self.settings.backoff_max_s)

    def _selector(self) -> dict[str, str]:
        return {"fieldSelector": f"spec.nodeName={self.settings.node}"} if self.settings.node else {}

    async def _relist(self) -> None:
        """List every pod, publish what changed against the stored records, and close the stories of pods now gone.

        The list's version is noted in KV first: the lanes finish its items in no particular order, so a
        crash midway lists that same version again and watches on from it, and a pod deleted meanwhile
        still gets its whole story from the watch's DELETED.
        """
        self.metrics.relists.inc()
        listing = await self._list()
        version = str(listing["metadata"]["resourceVersion"])
        async with self._state:
            if version != self._relist_at:
                await self._retrying("bus", self._note_relist, version)
            present = set()
            for pod in listing.get("items") or []:
                view = view_of(pod)
                if view is not None:
                    present.add(view.uid)
                    await self._submit(view.namespace, view.name, None, self._observe, view)
            for record in [r for r in self.records if r.uid not in present]:
                await self._submit(record.namespace, record.name, None, self._gone, record.uid, version)
            await self._progress.drained()
            self._read_version = self.resource_version = version
            self._progress.handled = version
            await self._retrying("bus", self._save_resume, force=True, locked=True)
            await self._retrying("bus", self._note_relist, None)
        log.info("pods listed and reconciled", extra={"resource_version": version, "tracked": len(self.records)})

    async def _list(self) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(sock_connect=self.settings.connect_timeout_s, total=self.settings.list_timeout_s)
        params = self._selector()
        if self._relist_at is not None:
            params |= {"resourceVersion": self._relist_at, "resourceVersionMatch": "Exact"}
        try:
            return dict(await self.api.get(PODS_PATH, params, timeout))
        except KubeApiError as error:
            if error.status != 410:
                raise
            if self._relist_at is None:
                raise _Gone from None
        log.info("the interrupted relist's version is compacted away; listing the current state", extra={"resource_version": self._relist_at})
        self._relist_at = None
        return await self._list()

    async def _note_relist(self, version: str | None) -> None:
        await self.lease.wait_held()
        kv = self.runtime.kv(self.settings.resume_bucket)
        if version is None:
            await kv.delete(self._relist_key)
        else:
            await kv.put(self._relist_key, version.encode())
        self._relist_at = version

    async def _watch(self) -> None:
        s = self.settings
        self.synced.set()  # listed now, or resuming from a version whose state KV holds
        self.metrics.synced.set(1)
        timeout = aiohttp.ClientTimeout(sock_connect=s.connect_timeout_s, sock_read=s.read_timeout_s)
        params = {"resourceVersion": self._read_version or "", "allowWatchBookmarks": "true", "timeoutSeconds": str(s.watch_timeout_s),
                  **self._selector()}
        try:
            async for event in self.api.watch(PODS_PATH, params, timeout):
                if self._stopping.is_set():
                    return
                await self._dispatch(event)
        except KubeApiError as error:
            if error.status == 410:
                raise _Gone from None
            raise

    async def _dispatch(self, event: dict[str, Any]) -> None:
        """Hand one watch event to its pod's lane; what needs no bus work is handled on the spot."""
        kind = str(event.get("type"))
        self.metrics.changed(kind)
        pod = event.get("object") or {}
        meta = pod.get("metadata") or {}
        version = str(meta.get("resourceVersion") or "") or None
        if kind == "BOOKMARK":
            if version:
                self._read_version = version
                self._progress.enter(version, done=True)
            return
        view = view_of(pod)
        if kind == "DELETED":
            # By uid too: a pod whose GPU annotations were removed before deletion still ends its story.
            await self._submit(str(meta.get("namespace", "")), str(meta.get("name", "")), version, self._deleted, view, meta)
        elif view is not None:
            await self._submit(view.namespace, view.name, version, self._observe, view)
        elif version:
            self._progress.enter(version, done=True)
        if version:
            self._read_version = version

    async def _submit(self, namespace: str, name: str, version: str | None, action: Callable[..., Awaitable[None]], *args: Any) -> None:
        if len(self._progress) >= self._progress.limit:
            await self._progress.room()  # backpressure: the watch is not read while the lanes are full
        self._lanes.submit(f"{namespace}/{name}", version, action, *args)

    # --- one pod (on its lane) ----------------------------------------------------------

    async def _observe(self, view: PodView) -> None:
        record = self.records.get(view.uid)
        if record is not None and closed(record):
            return  # a replay (after a takeover or crash) of a pod whose story is already closed
        limit = await self._expected_limit(view) if needs_limit(view, record) else None
        events, updated = advance(view, record, limit)
        if not events:
            return
        # Write-ahead: the record names the events before they go out, so a crash in between
        # republishes exactly these (same Nats-Msg-Id) instead of deriving new ones.
        await self._retrying("bus", self.records.put, updated)
        for event in events:
            await self._retrying("bus", self.stream.publish, event)
        self.records.published(updated)

    async def _deleted(self, view: PodView | None, meta: dict[str, Any]) -> None:
        if view is not None:
            await self._observe(view)
        uid = str(meta.get("uid") or "")
        record = self.records.get(uid)
        if record is not None and not closed(record):
            await self._close(record, str(meta.get("resourceVersion") or ""))

    async def _gone(self, uid: str, version: str) -> None:
        """A relist no longer lists the pod: end its story, or forget it if that is done already."""
        record = self.records.get(uid)
        if record is None:
            return
        if closed(record):
            await self._retrying("bus", self.records.drop, record)
        else:
            await self._close(record, version)

    async def _close(self, record: PodRecord, version: str) -> None:
        self._limits.pop(record.uid, None)
        event = deletion(record, version)
        closing = record.model_copy(update={"pending": [event]})
        await self._retrying("bus", self.records.put, closing)
        await self._retrying("bus", self.stream.publish, event)
        ended = tombstone(closing)
        await self._retrying("bus", self.records.put, ended)
        self.records.note_tombstone(ended)

    async def _recover(self) -> None:
        """Finish what a crash interrupted: publish each record's pending events the stream does not have yet."""
        for record in [r for r in self.records if r.pending]:
            last_id = await self.stream.last_id(record.pending[0].subject())
            ids = [e.dedup_id() for e in record.pending]
            unsent = record.pending[ids.index(last_id) + 1:] if last_id in ids else record.pending
            for event in unsent:
                await self.stream.publish(event)
            if unsent:
                log.info("republished events interrupted by a crash", extra={"pod": f"{record.namespace}/{record.name}", "events": len(unsent)})
            if any(e.state == "deleted" for e in record.pending):
                await self.records.put(tombstone(record))
            else:
                self.records.published(record)

    async def _expected_limit(self, view: PodView) -> str | None:
        """Read the limit KAI granted: a literal env value, or the ConfigMap key its binder wrote."""
        source = view.limit
        if source is None:
            return None
        if source.literal is not None:
            return source.literal
        # Per pod: a recreated pod may reuse the ConfigMap name with another limit.
        key = (source.configmap or "", source.key)
        known = self._limits.get(view.uid, {})
        if key in known:
            return known[key]
        timeout = aiohttp.ClientTimeout(sock_connect=self.settings.connect_timeout_s, total=self.settings.list_timeout_s)
        try:
            body = await self.api.get(f"/api/v1/namespaces/{view.namespace}/configmaps/{source.configmap}", {}, timeout)
        except KubeApiError:
            return None  # not written (yet): KAI leaves the limit unset when its calculation fails
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            log.warning("cannot read the limit ConfigMap", extra={"pod": f"{view.namespace}/{view.name}", "error": repr(error)})
            return None
        value = (body.get("data") or {}).get(source.key)
        if value is not None:
            self._limits.setdefault(view.uid, {})[key] = value
        return value

    # --- the resume point ---------------------------------------------------------------

    async def _saver(self) -> None:
        """Save the resume point after every `resume_save_every` handled changes or `resume_save_interval_s`."""
        s = self.settings
        while True:
            await asyncio.sleep(min(s.resume_save_interval_s, 0.05))
            self.resource_version = self._progress.handled or self.resource_version
            self.metrics.in_flight.set(len(self._progress))
            self.metrics.tracked.set(len(self.records))
            if self._progress.advanced >= s.resume_save_every or time.monotonic() - self._saved_at >= s.resume_save_interval_s:
                await self._retrying("bus", self._save_resume)

    async def _save_resume(self, force: bool = False, locked: bool = False) -> None:
        self.resource_version = self._progress.handled or self.resource_version
        if not self._loaded or self.resource_version is None or self.resource_version == self._saved_version:
            return
        due = self._progress.advanced >= self.settings.resume_save_every or time.monotonic() - self._saved_at >= self.settings.resume_save_interval_s
        if not (force or due):
            return
        async with contextlib.nullcontext() if locked else self._state:
            version = self.resource_version
            await self.lease.wait_held()
            await self.runtime.kv(self.settings.resume_bucket).put(self._resume_key, version.encode())
            self._saved_version, self._saved_at = version, time.monotonic()
            self._progress.advanced = 0
            await self.records.drop_tombstones(version)
            self.metrics.tracked.set(len(self.records))

    async def _load_state(self) -> None:
        """Read the resume version and every pod record of this scope back from KV."""
        try:
            entry = await self.runtime.kv(self.settings.resume_bucket).get(self._resume_key)
            self.resource_version = self._saved_version = entry.value.decode() if entry.value else None
        except nats.js.errors.KeyNotFoundError:
            self.resource_version = None
        try:
            entry = await self.runtime.kv(self.settings.resume_bucket).get(self._relist_key)
            self._relist_at = entry.value.decode() if entry.value else None
        except nats.js.errors.KeyNotFoundError:
            self._relist_at = None
        self._read_version = None if self._relist_at else self.resource_version
        await self.records.load()
        self.metrics.tracked.set(len(self.records))
        log.info("watcher state loaded", extra={"scope": self.settings.scope, "resume": self.resource_version, "tracked": len(self.records)})

    async def _retrying(self, cause: str, action: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run a bus action until it succeeds. Meanwhile its lane waits, and with the lanes full the watch is not read."""
        delay = self.settings.backoff_base_s
        while True:
            try:
                return await action(*args, **kwargs)
            except (BusError, nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as error:
                await self.lease.wait_held()  # past its term a leader acts again only once it renewed (nobody took over)
                if self._stopping.is_set():
                    log.warning("bus unavailable while stopping; unsaved changes replay after restart", extra={"error": repr(error)})
                    raise _Stopping from None
                self.metrics.retries.labels(cause).inc()
                log.warning("bus unavailable; holding the watch until it returns", extra={"error": f"{type(error).__name__}: {error}", "retry_in_s": delay})
                # A leader elected or the connection back ends the wait: the retry comes then, not a backoff later.
                await self.runtime.healing.wait(delay)
                delay = min(delay * 2, self.settings.backoff_max_s)


def _unwrapped(error: BaseException | Any) -> BaseException | Any:
    """The one exception that ended a term, out of the TaskGroup's ExceptionGroup: a bug first, then a lost lease."""
    if not isinstance(error, BaseExceptionGroup):
        return error
    leaves = _leaves(error)
    bugs = [e for e in leaves if not isinstance(e, (LeaseLostError, _Stopping, asyncio.CancelledError))]
    lost = [e for e in leaves if isinstance(e, LeaseLostError)]
    return (bugs or lost or leaves)[0]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:  # type: ignore[type-arg]
    found: list[BaseException] = []
    for error in group.exceptions:
        found += _leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return found
