"""The verifier's handlers: running pod -> ask its node agent -> verdict on the bus, in KV and on the pod.

Pods to re-verify, the last observation per container, negative looks awaiting a second one and
the library version per node live in a KV bucket, so a restart repeats no verdict and forgets no
pod, and replicas sharing the work see one state. A periodic pass costs what is live and due: it
lists keys (one request per kind, `records.py`) and reads only the pods it is about to look at.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import nats.errors
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Histogram
from nats.js.errors import KeyWrongLastSequenceError
from pydantic import BaseModel, Field

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import IsolatorError, NotYet
from kai_isolator.shared.events import HealthVerdict, InspectReply, InspectRequest, NodeStatus, PodIsolation, UsageReport
from kai_isolator.shared.lease import Lease

from . import records
from .inflight import InFlight
from .judge import Judgement, judge, judge_unobservable, judge_without_inspection
from .kube import PodNotifier
from .records import PENDING, POD, UNSEEN, VERDICT
from .settings import VerifierSettings
from .view import NodeViews

log = logging.getLogger(__name__)


class NotObservableYet(NotYet):
    """The container cannot be inspected yet (no node or container assigned, no process started): retry, never guess."""


class NoProcessSeen(NotObservableYet):
    """The node agent answered, and found no process of the container."""


# What a pass over the tracked pods may meet while NATS is away or restarting: logged, retried next pass.
BUS_FAILURES = (IsolatorError, nats.errors.Error, asyncio.TimeoutError)


class UnseenRecord(BaseModel):
    """Inspections in a row that found no process of a container, since when (epoch seconds)."""

    count: int
    since: float


class VerdictRecord(BaseModel):
    observation: str
    verdict: str


class PendingRecord(BaseModel):
    """A negative observation from one look inside a container, since when (epoch seconds)."""

    observation: str
    since: float


class NodeVersionRecord(BaseModel):
    """The library version a node runs, as the report that changed it said (KV `nodeversion.<node>`).

    Shared by every replica, because node-status reports are split between them: a replica that
    kept versions in memory would miss a change whose previous report went to another one.
    """

    version: str | None
    sequence: int = Field(description="the node agent's sequence of the report that set this version")
    reverify: bool = Field(False, description="the node's pods are still to be re-verified for this change")


# Compare-and-set attempts on a node's version record before the report is retried (nak) instead.
NODE_VERSION_CAS_ATTEMPTS = 10


class Verifier:
    """Bound to a started Runtime that provisioned `settings.health_bucket`."""

    def __init__(self, runtime: Runtime, settings: VerifierSettings, notifier: PodNotifier | None, pass_lease: Lease | None = None) -> None:
        self.runtime = runtime
        self.settings = settings
        self.notifier = notifier
        # Events are shared between replicas by the consumer; the periodic passes go over every pod,
        # so only the replica holding this lease runs them (None: no replicas to share with).
        self.pass_lease = pass_lease
        self.library_path = f"{settings.container_vgpu_mount.rstrip('/')}/libvgpu.so"
        # What operators read in the API (kubectl isolator): node views from the agents' reports.
        self.views = NodeViews(notifier, heartbeat_s=settings.node_view_heartbeat_s) if notifier and settings.node_views else None
        registry = runtime.metrics.registry
        self.verdicts = Counter("kai_isolator_verdicts", "Verdicts emitted, by verdict and reason", ["verdict", "reason"], registry=registry)
        self.latency = Histogram("kai_isolator_verification_seconds", "From inspection request to verdict", registry=registry)
        self.passes = Counter("kai_isolator_reverify_passes", "Periodic re-verification passes, by outcome (ok, failed, standby: "
                              "another replica runs them)", ["outcome"], registry=registry)
        self.deferred = Counter("kai_isolator_verdicts_deferred", "Negative observations held for a second look before any verdict", registry=registry)
        self.in_flight = InFlight()
        # Pods without a verdict at the last pass: a pod new since is left to its event handler (here
        # or on another replica, mid-verification) for one pass before the pass retries it.
        self._unjudged_at_last_pass: set[str] = set()

    def bind(self) -> None:
        self.runtime.on_event("pods", subjects.ALL_PODS, self.on_pod)
        self.runtime.on_event("nodes", subjects.ALL_NODE_STATUS, self.on_node_status, new_only=True)
        if self.notifier is not None:
            self.runtime.on_event("breaches", subjects.ALL_HEALTH, self.on_health, new_only=True)
        if self.views is not None:
            # Views need every report, not the share the consumers give this replica; the replica that
            # holds the pass lease writes them (`views_leading`).
            self.runtime.on_broadcast(subjects.ALL_NODE_STATUS, self.on_status_view)
            self.runtime.on_broadcast(subjects.ALL_USAGE, self.on_usage)
            self.runtime.on_broadcast(subjects.ALL_PODS, self.on_pod_view)

    @property
    def _kv(self) -> KeyValue:
        return self.runtime.kv(self.settings.health_bucket)

    # --- handlers -------------------------------------------------------------------------

    async def on_pod(self, event: PodIsolation) -> None:
        if event.state in ("finished", "deleted"):
            await self._forget(event)
        elif event.state == "running" and not await self._is_gone(event):
            await self._remember(event)
            await self.verify(event)

    async def on_node_status(self, status: NodeStatus) -> None:
        """A node whose library version changed gets all its running pods verified again, once across replicas."""
        revision = await self._claim_version_change(status)
        if revision is None:
            return
        log.info("library version changed; re-verifying the node's pods", extra={"node": status.node_name, "version": status.active_version})
        for pod in await self.tracked_pods():
            if pod.node_name == status.node_name:
                await self._verify_logged(pod)
        done = NodeVersionRecord(version=status.active_version, sequence=status.sequence)
        # A newer change written meanwhile keeps its own flag: then this CAS fails, as it should.
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self._kv.update(self._node_version_key(status.node_name), done.model_dump_json().encode(), last=revision)

    @staticmethod
    def _node_version_key(node: str) -> str:
        return f"nodeversion.{node}"

    async def _claim_version_change(self, status: NodeStatus) -> int | None:
        """The KV revision under which this report owns a re-verification of its node's pods, or None.

        One compare-and-set per version change: of two replicas handling reports of one change,
        only the one whose write lands re-verifies. A report older than the recorded one (handled
        late by another replica) changes nothing; the very report that recorded a change, seen
        again (redelivered after its handler died mid-way), owns the re-verification still
        flagged. The first report of a node is recorded without re-verifying (nothing to compare).
        Reports repeating the recorded version write nothing, so heartbeats cost one read.
        """
        key = self._node_version_key(status.node_name)
        for _ in range(NODE_VERSION_CAS_ATTEMPTS):
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                entry = None
            record = _node_version(entry.value if entry is not None else None)
            if record is not None and entry is not None:
                revision = entry.revision or 0
                if status.sequence == record.sequence:
                    return revision if record.reverify else None
                if status.sequence < record.sequence or status.active_version == record.version:
                    return None
                changed = NodeVersionRecord(version=status.active_version, sequence=status.sequence, reverify=True)
                try:
                    return await self._kv.update(key, changed.model_dump_json().encode(), last=revision)
                except KeyWrongLastSequenceError:
                    continue  # another replica recorded a report first: judge against it
            first = NodeVersionRecord(version=status.active_version, sequence=status.sequence)
            try:
                if entry is None:
                    await self._kv.create(key, first.model_dump_json().encode())
                else:  # unreadable or purged: start over from this report
                    await self._kv.update(key, first.model_dump_json().encode(), last=entry.revision or 0)
                return None
            except KeyWrongLastSequenceError:
                continue
        raise IsolatorError(f"version record of node {status.node_name} keeps changing under us; retrying the report")

    async def on_health(self, verdict: HealthVerdict) -> None:
        """The node agent's `breached` verdicts reach the pod condition too (the verifier writes its own verdicts there)."""
        if verdict.verdict == "breached" and self.notifier is not None and self.settings.pod_condition:
            await self.notifier.set_condition(verdict)

    async def on_usage(self, report: UsageReport) -> None:
        if self.views is not None:
            self.views.on_usage(report)

    async def on_status_view(self, status: NodeStatus) -> None:
        if self.views is not None:
            self.views.on_status(status)

    async def on_pod_view(self, event: PodIsolation) -> None:
        if self.views is not None and event.state in ("finished", "deleted"):
            self.views.forget_pod(event.pod.uid)

    def views_leading(self) -> bool:
        """Whether this replica writes the node views: the one holding the pass lease (or the only one)."""
        return self.pass_lease is None or self.pass_lease.held()

    # --- verification ---------------------------------------------------------------------

    async def verify(self, pod: PodIsolation, *, unless_in_flight: bool = False) -> HealthVerdict | None:
        """Emit the verdict for this pod unless this exact observation was already emitted.

        A negative verdict from one look inside the container is held until a second look, at
        least `confirm_negative_after_s` later, sees the same: a container being set up (its
        set-up process already in the pod's cgroup, the preload not yet mounted) is not yet
        what it will run as. None when nothing was emitted.

        One verification of a pod at a time in this replica: a second waits for the first, or,
        `unless_in_flight`, is dropped (None) at once.
        """
        async with self.in_flight.claim(pod.pod.uid, wait=not unless_in_flight) as claimed:
            return await self._verify(pod) if claimed else None

    async def _verify(self, pod: PodIsolation) -> HealthVerdict | None:
        started = time.perf_counter()
        judgement, one_look = judge_without_inspection(pod), False
        if judgement is None:
            judgement, one_look = await self._judge_inspected(pod)
        container = pod.container or ""
        key = self._verdict_key(pod)
        if await self._last_observation(key) == judgement.observation:
            await self._drop_pending(pod)
            return None
        if one_look and judgement.verdict != "verified" and not await self._seen_twice(pod, judgement):
            return None
        verdict = HealthVerdict(
            pod=pod.pod, node_name=pod.node_name or "", container=container,
            verdict=judgement.verdict, reasons=list(judgement.reasons), observation=judgement.observation, held=judgement.held,
        )
        await self.runtime.publish(verdict)
        await self._tell_kubernetes(verdict)
        await self._kv.put(key, VerdictRecord(observation=judgement.observation, verdict=judgement.verdict).model_dump_json().encode())
        await self._drop_pending(pod)
        self._count(judgement)
        self.latency.observe(time.perf_counter() - started)
        log.info("verdict", extra={"pod": f"{pod.pod.namespace}/{pod.pod.name}", "verdict": verdict.verdict,
                                   "reasons": ",".join(r.code for r in verdict.reasons) or "-"})
        return verdict

    @staticmethod
    def _pending_key(pod: PodIsolation) -> str:
        return records.container_key(PENDING, pod)

    async def _pending(self, pod: PodIsolation) -> PendingRecord | None:
        entry = await self._read(self._pending_key(pod))
        try:
            return PendingRecord.model_validate_json(entry.value or b"") if entry is not None else None
        except ValueError:
            return None

    async def _seen_twice(self, pod: PodIsolation, judgement: Judgement) -> bool:
        """True on the second look that sees this negative observation late enough; else remember this look."""
        pending = await self._pending(pod)
        if pending is not None and pending.observation == judgement.observation:
            return time.time() - pending.since >= self.settings.confirm_negative_after_s
        await self._kv.put(self._pending_key(pod), PendingRecord(observation=judgement.observation, since=time.time()).model_dump_json().encode())
        self.deferred.inc()
        log.info("negative observation held for a second look", extra={
            "pod": f"{pod.pod.namespace}/{pod.pod.name}", "verdict": judgement.verdict,
            "reasons": ",".join(r.code for r in judgement.reasons), "confirm_after_s": self.settings.confirm_negative_after_s})
        return False

    async def _drop_pending(self, pod: PodIsolation) -> None:
        # Removed from the stream, not purged: a marker would keep the pod listed as pending. Up to
        # the record read only, so a look recorded meanwhile (another replica's) stays.
        key = self._pending_key(pod)
        entry = await self._read(key)
        if entry is not None:
            await records.remove(self.runtime, self.settings.health_bucket, key, before_revision=(entry.revision or 0) + 1)

    @staticmethod
    def _verdict_key(pod: PodIsolation) -> str:
        return records.container_key(VERDICT, pod)

    async def _judge_inspected(self, pod: PodIsolation) -> tuple[Judgement, bool]:
        """The verdict from the node agent's view, and whether it rests on this one look;
        `unobservable` (already many looks) once the agent kept finding nothing."""
        key = records.container_key(UNSEEN, pod)
        try:
            reply = await self._inspect(pod)
        except NoProcessSeen:
            unseen = await self._count_unseen(key)
            wanted, after = self.settings.unobservable_inspections, self.settings.unobservable_after_s
            if unseen.count >= wanted and time.time() - unseen.since >= after:
                return judge_unobservable(pod, wanted, after), False
            raise
        with contextlib.suppress(KeyNotFoundError):
            if (await self._kv.get(key)).value:
                await self._kv.purge(key)  # seen again: the count starts over
        return judge(pod, reply, self.library_path), True

    async def _count_unseen(self, key: str) -> UnseenRecord:
        try:
            entry = await self._kv.get(key)
            previous = UnseenRecord.model_validate_json(entry.value or b"")
            unseen = UnseenRecord(count=previous.count + 1, since=previous.since)
        except (KeyNotFoundError, ValueError):
            unseen = UnseenRecord(count=1, since=time.time())
        await self._kv.put(key, unseen.model_dump_json().encode())
        return unseen

    async def _inspect(self, pod: PodIsolation) -> InspectReply:
        if not pod.node_name or not pod.container:
            raise NotObservableYet(f"{pod.pod.namespace}/{pod.pod.name} has no node or target container yet")
        request = InspectRequest(node_name=pod.node_name, pod=pod.pod, container=pod.container)
        reply = await self.runtime.request(request, timeout_s=self.settings.inspect_timeout_s)
        if not isinstance(reply, InspectReply):
            raise IsolatorError(f"node agent answered {reply.event_type}, not an inspection")  # a fault, not a "not yet"
        if not reply.found or not reply.processes:
            raise NoProcessSeen(f"no process of {pod.pod.namespace}/{pod.pod.name}:{pod.container} on {pod.node_name}: {reply.message}")
        return reply

    async def _tell_kubernetes(self, verdict: HealthVerdict) -> None:
        if self.notifier is None:
            return
        await self.notifier.post_event(verdict)
        if self.settings.pod_condition:
            await self.notifier.set_condition(verdict)
        if verdict.verdict == "missing" and self.settings.on_missing == "annotate":
            await self.notifier.annotate_missing(verdict)
        elif verdict.verdict == "missing" and self.settings.on_missing == "evict":
            await self.notifier.evict(verdict)

    def _count(self, judgement: Judgement) -> None:
        for reason in judgement.reasons or ():
            self.verdicts.labels(judgement.verdict, reason.code).inc()
        if not judgement.reasons:
            self.verdicts.labels(judgement.verdict, "none").inc()

    async def _last_observation(self, key: str) -> str | None:
        entry = await self._read(key)
        return VerdictRecord.model_validate_json(entry.value).observation if entry is not None and entry.value else None

    async def _read(self, key: str) -> KeyValue.Entry | None:
        """The key's entry, None when it has none. A delete or purge marker met (written by an older
        version, which purged through the KV API) is removed from the stream, so no listing shows it again."""
        try:
            return await self._kv.get(key)
        except KeyNotFoundError as error:
            if (revision := _marker_revision(error)) is not None:
                await records.remove(self.runtime, self.settings.health_bucket, key, before_revision=revision + 1)
            return None

    # --- the set of pods to re-verify -----------------------------------------------------

    async def _remember(self, pod: PodIsolation) -> None:
        await self._kv.put(records.pod_key(pod.pod.uid), pod.model_dump_json().encode())

    async def _forget(self, pod: PodIsolation) -> None:
        # The tombstone stops a late redelivery of the pod's `running` event from reviving it.
        await self._kv.put(f"gone.{pod.pod.uid}", b"")
        # After this replica's verification of the pod, if one is in flight: else it would write its
        # verdict back after the removal, a record of a pod nobody tracks.
        async with self.in_flight.claim(pod.pod.uid):
            await records.remove_pod(self.runtime, self.settings.health_bucket, pod.pod.uid)

    async def _is_gone(self, pod: PodIsolation) -> bool:
        try:
            await self._kv.get(f"gone.{pod.pod.uid}")
        except KeyNotFoundError:
            return False
        return True

    async def tracked_pods(self) -> list[PodIsolation]:
        """The pods to re-verify (BusError or a NATS error while the bus is away)."""
        return await self._read_pods(await self._listed(POD))

    async def _listed(self, kind: str) -> set[str]:
        return await records.listed_uids(self.runtime, self.settings.health_bucket, kind)

    async def _read_pods(self, uids: set[str]) -> list[PodIsolation]:
        pods = []
        for uid in sorted(uids):
            if (pod := await self._read_pod(uid)) is not None:
                pods.append(pod)
        return pods

    async def _read_pod(self, uid: str) -> PodIsolation | None:
        """The tracked pod, None when forgotten since the listing. A purge marker an older version left
        (it purged through the KV API) is removed with the pod's other keys: it is never listed again."""
        key = records.pod_key(uid)
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError as error:
            if (revision := _marker_revision(error)) is not None:
                await records.remove(self.runtime, self.settings.health_bucket, key, before_revision=revision + 1)
                await records.remove_container_keys(self.runtime, self.settings.health_bucket, uid)
            return None
        return PodIsolation.model_validate_json(entry.value) if entry.value else None

    async def due_pods(self, full: bool) -> list[PodIsolation]:
        """The pods a pass looks at: every tracked one when `full`; else those without a verdict since
        the last pass, and those with a negative look awaiting its second. Listings, then reads of these only."""
        # Listed before the pods: a pod's verdict and looks are written after its record, so one whose
        # pod is not listed after them belongs to a forgotten pod (its removal raced a verification).
        judged, pending = await self._listed(VERDICT), await self._listed(PENDING)
        live = await self._listed(POD)
        unjudged = live - judged
        due = live if full else (unjudged & self._unjudged_at_last_pass) | (pending & live)
        self._unjudged_at_last_pass = unjudged
        await self._remove_orphans((judged | pending) - live)
        pods = await self._read_pods(due)
        return pods if full else [pod for pod in pods if await self._still_due(pod)]

    async def _still_due(self, pod: PodIsolation) -> bool:
        """The listings' answer for this pod's own container, read now (a verdict may have landed since)."""
        return await self._last_observation(self._verdict_key(pod)) is None or await self._pending(pod) is not None

    async def _remove_orphans(self, uids: set[str]) -> None:
        for uid in sorted(uids):
            await records.remove_container_keys(self.runtime, self.settings.health_bucket, uid)

    async def reverify_forever(self) -> None:
        """Every pod each `reverify_s`; pods without a verdict yet (agent was silent; from the second
        pass that finds them so) or with a negative look awaiting its second one each `pending_retry_s`.
        A pass that fails (NATS away) is logged and counted, and the next one runs on time: this loop
        never ends early."""
        tick = min(self.settings.reverify_s, self.settings.pending_retry_s)
        since_full = 0.0
        while True:
            await asyncio.sleep(tick)
            since_full += tick
            full = since_full >= self.settings.reverify_s
            if self.pass_lease is not None and not self.pass_lease.held():
                self.passes.labels("standby").inc()
                continue
            try:
                await self.reverify_pass(full)
            except BUS_FAILURES as error:
                self.passes.labels("failed").inc()
                log.warning("re-verification pass failed; retrying next pass", extra={"full": full, "error": f"{type(error).__name__}: {error}"})
                continue
            except Exception:  # noqa: BLE001 - a bug in one pass must not end re-verification for good
                self.passes.labels("failed").inc()
                log.exception("re-verification pass failed unexpectedly; retrying next pass")
                continue
            self.passes.labels("ok").inc()
            if full:
                since_full = 0.0  # only a completed full pass resets the clock: a failed one is redone next tick

    async def lead_passes_forever(self) -> None:
        """Hold the pass lease whenever no other replica does: stand by, lead until lost, repeat."""
        if self.pass_lease is None:
            return
        while True:
            await self.pass_lease.acquire()
            await self.pass_lease.keep()

    async def reverify_pass(self, full: bool) -> None:
        """One pass over the due pods (every pod when `full`); a pod being verified here already is left to that verification."""
        for pod in await self.due_pods(full):
            await self._verify_logged(pod, unless_in_flight=True)

    async def _verify_logged(self, pod: PodIsolation, *, unless_in_flight: bool = False) -> None:
        try:
            await self.verify(pod, unless_in_flight=unless_in_flight)
        except NotObservableYet as error:
            log.info("cannot look inside the container yet; next pass looks again", extra={
                "pod": f"{pod.pod.namespace}/{pod.pod.name}", "why": str(error)})
        except BUS_FAILURES as error:
            log.warning("re-verification deferred", extra={"pod": f"{pod.pod.namespace}/{pod.pod.name}", "error": f"{type(error).__name__}: {error}"})


def _node_version(value: bytes | None) -> NodeVersionRecord | None:
    if not value:
        return None
    try:
        return NodeVersionRecord.model_validate_json(value)
    except ValueError:
        return None


def _marker_revision(error: KeyNotFoundError) -> int | None:
    """The revision of the delete or purge marker a read met; None when the key has no message at all."""
    marker = getattr(error, "entry", None)
    return marker.revision if marker is not None and marker.revision else None
