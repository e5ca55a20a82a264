"""The enforcer: holds every GPU-sharing container on the node to its grant from the driver's own view
(NVML, host PIDs, kubelet cgroups), whatever the container does in process; kills, evicts or warns on a breach.

Each poll takes one complete snapshot of the driver's per-process device memory, attributes every host
PID to (pod, container) by its kubelet cgroup (never by anything the process can change; a cgroup the
tenant made below its container's is still the container's), sums per container and device, and
compares with the node-written grant plus one allowance per container for the driver's context
reservations. Every container of a GPU-sharing pod is held to what the node granted it: nothing,
without allowance, for a sidecar or a target whose grant was withheld. A GPU that KAI shares (one of its
reservation pods holds it) is for its grant holders only: a container of any other pod on the node is held
to nothing there, and judged nowhere else. Every complete poll that finds
a container over acts (on_breach kill: again on each such poll, sparing what was already killed; a
container that keeps coming back over is evicted). A poll that is not complete acts on nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kai_isolator.shared.cgroups import ContainerCgroup, container_id_from_status, parse_proc_cgroup
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.events import (
    Breach, BreachAction, BreachedProcess, DriverDeviceUsage, HealthVerdict, InspectReply, PodRef, Reason,
)
from kai_isolator.shared.grant import Grant

from . import grant_files
from .nvml import DriverSnapshot, NvmlError

log = logging.getLogger(__name__)
_JITTER = random.SystemRandom()  # poll times the tenant cannot predict from earlier ones

Obj = dict[str, Any]
OnBreach = Literal["kill", "evict", "warn"]
MIB = 1 << 20
DEFAULT_TOLERANCE_MIB = 512
"""Allowed per container and device on top of a grant, however many processes the container runs:
NVML's usedGpuMemory includes what the driver reserves for each context (local memory for every
resident thread's stack, the malloc heap and printf FIFO, context state, loaded modules), which the
library never sees as an allocation. One bare CUDA 12 context on a Hopper card is about 300 MiB
(132 SMs x 2048 threads x 1 KiB of stack alone is 264 MiB); 512 MiB covers one context with a
framework's lazily loaded modules. It is the container's, not each process's, so that splitting the
work across processes buys nothing: a container running several contexts on one device keeps the
others' reservations inside its grant. `hami-core/gpu-check.sh` prints the figure measured on the
node's own card to tune it by (`--breach-tolerance-mib`)."""
DEFAULT_ESCALATE_AFTER = 3
"""Breaches of one container within DEFAULT_ESCALATE_WINDOW_S after which killing is not enough and the
pod is evicted: a relay of processes that each take the memory when the last one dies."""
DEFAULT_ESCALATE_WINDOW_S = 60.0
DEFAULT_RELEASE_GRACE_S = 5.0
"""How long a killed process's memory may still show in the driver before it counts again: a real driver
tears a context down in well under a second; one that does not die (stuck in the driver) is not released."""
UNLISTED_GRACE_S = 5.0
"""How long a container of a GPU-sharing pod may run before its id is in the pod's status (the kubelet
reports a new container within a second or two); after that it is held to nothing."""


@dataclass(frozen=True, slots=True)
class Identity:
    """A process, not just a PID: the start time (clock ticks after boot) tells a reused PID apart."""

    pid: int
    start_time: int


def _read(path: str) -> bytes | None:
    # os-level reads: this runs for every GPU process on every poll, and pathlib costs more than the read.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


def start_time(proc_root: Path, pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat; None when the process is gone."""
    data = _read(f"{proc_root}/{pid}/stat")
    if data is None:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def identify(proc_root: Path, pid: int) -> tuple[Identity, ContainerCgroup | None] | None:
    """The process's identity and kubelet container, read so that both describe one process: the
    start time is read before and after the cgroup, and a PID that changed hands meanwhile is skipped."""
    before = start_time(proc_root, pid)
    if before is None:
        return None
    cgroup = _read(f"{proc_root}/{pid}/cgroup")
    if cgroup is None or start_time(proc_root, pid) != before:
        return None
    return Identity(pid, before), parse_proc_cgroup(cgroup.decode(errors="replace"))


KillOutcome = Literal["killed", "gone", "not-the-same-process", "left-the-container"]


def kill_verified(proc_root: Path, identity: Identity, owner: ContainerCgroup) -> KillOutcome:
    """SIGKILL exactly this process, and only while it still is the one attributed and in its container.

    The pidfd pins the process the PID names at the moment it is opened; its identity is then checked
    through /proc, and the signal goes through the pidfd. If the PID was reused before the open, the
    start time differs and nothing is sent; if the process dies after the check, the signal fails
    harmlessly (ESRCH) rather than reaching whoever takes the PID next.
    """
    try:
        pidfd = os.pidfd_open(identity.pid)
    except ProcessLookupError:
        return "gone"
    try:
        found = identify(proc_root, identity.pid)
        if found is None:
            return "gone"
        now, cgroup = found
        if now != identity:
            return "not-the-same-process"
        if cgroup is None or (cgroup.pod_uid, cgroup.container_id) != (owner.pod_uid, owner.container_id):
            return "left-the-container"
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return "gone"
        return "killed"
    finally:
        os.close(pidfd)


# --- who a process belongs to --------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A GPU-sharing container held to a grant: the pod, the container's name and runtime id, the limits."""

    pod: PodRef
    container: str  # "" while the pod's status does not list the container's id
    container_id: str
    limits: Mapping[str, int]  # device UUID -> bytes; a device not here is granted nothing
    withheld: str = ""  # why the node granted this container nothing
    outside_sharing: bool = False  # a container of a pod outside GPU sharing: judged only on GPUs KAI shares

    @property
    def key(self) -> tuple[str, str]:
        return self.pod.uid, self.container or f"id-{self.container_id}"


def container_name(pod: Obj, container_id: str) -> str | None:
    """The name `status.containerStatuses` (or init / ephemeral statuses) gives a runtime container id."""
    status = pod.get("status") or {}
    for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        for item in status.get(key) or []:
            if isinstance(item, dict) and container_id_from_status(str(item.get("containerID") or "")) == container_id:
                return str(item.get("name") or "") or None
    return None


Withheld = Callable[[str, str], "str | None"]
SharedGpus = Callable[[], Collection[str]]


def _pod_ref(pod: Obj, uid: str) -> PodRef:
    meta = pod.get("metadata") or {}
    return PodRef(namespace=str(meta.get("namespace") or ""), name=str(meta.get("name") or ""), uid=uid)


class KnownPods:
    """The pods bound to this node (from the agent's pod watch), the grant files of the GPU-sharing ones, and
    the GPUs KAI shares there.

    Every container of a GPU-sharing pod is held to what the node granted it, and that is nothing where no
    grant was written (a sidecar, a target whose grant was withheld: `withheld` tells why, from the
    grant keeper). Every container of any other pod (`others`: the agent never lists KAI's reservation pods
    there) is held to nothing on a GPU in `shared`, and judged on no other GPU: a whole GPU no reservation pod
    holds is not ours to judge. What is left is `unattributed`, reported and never touched: processes of no
    pod the node knows, and a container for the few seconds before its id reaches its GPU-sharing pod's status.
    Whom a process belongs to comes from its kubelet cgroup and the API's pods, never from the container.
    """

    def __init__(self, grant_root: Path, pods: Callable[[], Mapping[str, Obj]], withheld: Withheld | None = None,
                 unlisted_grace_s: float = UNLISTED_GRACE_S, *, others: Callable[[], Mapping[str, Obj]] | None = None,
                 shared: SharedGpus | None = None) -> None:
        self.grant_root = grant_root
        self.pods = pods
        self.withheld = withheld
        self.unlisted_grace_s = unlisted_grace_s
        self.others = others
        self.shared = shared
        self._grants: dict[tuple[str, str], tuple[int, Grant | None]] = {}
        self._unlisted: dict[tuple[str, str], float] = {}  # (pod uid, container id) -> first seen

    def shared_gpus(self) -> frozenset[str]:
        """The UUIDs of the GPUs KAI's reservation pods on this node hold: for their grant holders only."""
        return frozenset(self.shared()) if self.shared is not None else frozenset()

    def target(self, owner: ContainerCgroup) -> Target | str:
        """The container a kubelet cgroup names and what it is held to, or why it is not held to anything."""
        pod = self.pods().get(owner.pod_uid)
        if pod is None:
            return self._outside_sharing(owner)
        ref = _pod_ref(pod, owner.pod_uid)
        name = container_name(pod, owner.container_id)
        if name is None:
            first = self._unlisted.setdefault((owner.pod_uid, owner.container_id), time.monotonic())
            if time.monotonic() - first < self.unlisted_grace_s:
                return "container id not in the pod's status (yet)"
            return Target(ref, "", owner.container_id, {}, withheld=f"no grant: container {owner.container_id[:12]} is not in the "
                                                                   f"pod's status after {self.unlisted_grace_s:g}s")
        grant = self._grant(owner.pod_uid, name)
        if grant is None:
            why = self.withheld(owner.pod_uid, name) if self.withheld is not None else None
            return Target(ref, name, owner.container_id, {}, withheld=f"no grant was written for container {name}" + (f" ({why})" if why else ""))
        return Target(ref, name, owner.container_id, {d.uuid: d.limit_bytes for d in grant.devices})

    def _outside_sharing(self, owner: ContainerCgroup) -> Target | str:
        """A container of a pod outside GPU sharing: granted nothing anywhere (the enforcer judges it only on a GPU
        KAI shares), named from its pod's status where listed, by its runtime id until then."""
        pod = self.others().get(owner.pod_uid) if self.others is not None else None
        if pod is None:
            return "not a pod known on this node" if self.others is not None else "not a GPU-sharing pod known on this node"
        name = container_name(pod, owner.container_id) or ""
        return Target(_pod_ref(pod, owner.pod_uid), name, owner.container_id, {}, outside_sharing=True,
                      withheld="the pod is outside GPU sharing, and a GPU that KAI shares is for its grant holders only")

    def _grant(self, uid: str, container: str) -> Grant | None:
        # Re-read only when the file changed: the grant keeper replaces it by rename, so the inode moves.
        try:
            path = grant_files.grant_path(self.grant_root, uid, container)
            stamp = path.stat().st_ino
        except (OSError, ConfigError):
            return None
        cached = self._grants.get((uid, container))
        if cached is None or cached[0] != stamp:
            cached = (stamp, grant_files.read_grant(self.grant_root, uid, container))
            self._grants[(uid, container)] = cached
        return cached[1]

    def forget_except(self, live: set[tuple[str, str]]) -> None:
        for key in [k for k in self._grants if k not in live]:
            del self._grants[key]
        pods = self.pods()
        for key in [k for k in self._unlisted if k[0] not in pods]:
            del self._unlisted[key]


# --- one poll ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    identity: Identity
    owner: ContainerCgroup
    device_uuid: str
    used_bytes: int | None


@dataclass(frozen=True)
class Unattributed:
    pid: int
    device_uuid: str
    used_bytes: int | None
    why: str


@dataclass
class Measure:
    """One container on one device in one poll."""

    target: Target
    device_uuid: str
    processes: list[Held] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(p.used_bytes is not None for p in self.processes)

    @property
    def used_bytes(self) -> int:
        return sum(p.used_bytes or 0 for p in self.processes)

    @property
    def limit_bytes(self) -> int:
        return self.target.limits.get(self.device_uuid, 0)  # a device not in the grant is granted nothing


@dataclass
class Poll:
    """What one poll saw and did."""

    ok: bool
    error: str = ""
    measures: list[Measure] = field(default_factory=list)
    unattributed: list[Unattributed] = field(default_factory=list)
    by_pid: dict[int, int] = field(default_factory=dict)  # host pid -> bytes on all devices (attributed or not)
    devices: tuple[str, ...] = ()  # UUIDs by NVML index
    breaches: list[tuple[Target, Breach]] = field(default_factory=list)
    seconds: float = 0.0
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Episode:
    """A container's time over its grant on one device: counted until it is a breach; warn and evict act
    on it once, kill on every poll it lasts."""

    over: int = 0
    breach: Breach | None = None


Snapshot = Callable[[], DriverSnapshot]
Report = Callable[[Target, Breach], Awaitable[None]]
Evict = Callable[[PodRef], Awaitable[bool]]


class Enforcer:
    """Polls the driver and acts on breaches. `snapshot` is called in a worker thread and returns one
    complete DriverSnapshot or raises NvmlError; `report` publishes the verdict, Event and metric."""

    def __init__(self, snapshot: Callable[[], DriverSnapshot], pods: KnownPods, report: Report, *, proc_root: Path = Path("/proc"),
                 on_breach: OnBreach = "kill", tolerance_bytes: int = DEFAULT_TOLERANCE_MIB * MIB, polls_to_breach: int = 1,
                 evict: Evict | None = None, escalate_after: int = DEFAULT_ESCALATE_AFTER,
                 escalate_window_s: float = DEFAULT_ESCALATE_WINDOW_S, release_grace_s: float = DEFAULT_RELEASE_GRACE_S) -> None:
        self.snapshot = snapshot
        self.pods = pods
        self.report = report
        self.proc_root = proc_root
        self.on_breach: OnBreach = on_breach
        self.tolerance_bytes = tolerance_bytes
        self.polls_to_breach = polls_to_breach
        self.evict = evict
        self.escalate_after = escalate_after
        self.escalate_window_s = escalate_window_s
        self.release_grace_s = release_grace_s
        self.episodes: dict[tuple[str, str, str], _Episode] = {}
        self.killed: dict[Identity, float] = {}  # signalled; their memory is being torn down by the driver
        self.strikes: dict[tuple[str, str], list[float]] = {}  # container -> when it was acted on, within the window
        self.evicted: dict[str, float] = {}  # pod uid -> when its eviction was asked for
        self.acted = False  # the last poll acted: the next one comes sooner, for a relay or a kill not yet released
        self.last: Poll | None = None
        self._lock = asyncio.Lock()

    @property
    def healthy(self) -> bool:
        return self.last is not None and self.last.ok

    async def poll(self) -> Poll:
        """One round: snapshot, attribute, compare, act. Rounds never overlap."""
        async with self._lock:
            started = time.perf_counter()
            try:
                snap = await asyncio.to_thread(self.snapshot)
            except NvmlError as error:
                # No complete view: nothing counts toward a breach, and nothing is acted on.
                for episode in self.episodes.values():
                    episode.over = 0
                result = Poll(ok=False, error=str(error), seconds=time.perf_counter() - started)
                self.last = result
                return result
            result = await asyncio.to_thread(self.attribute, snap)
            await self._judge(result)
            result.seconds = time.perf_counter() - started
            self.last = result
            return result

    def attribute(self, snap: DriverSnapshot) -> Poll:
        """Every process the driver reports, as one container's on one device, or unattributed."""
        result = Poll(ok=True, at=snap.taken_at, devices=snap.devices)
        measures: dict[tuple[str, str, str], Measure] = {}
        seen: set[Identity] = set()
        targets: dict[ContainerCgroup, Target | str] = {}  # one lookup per container and poll
        shared = self.pods.shared_gpus()
        for entry in snap.processes:
            result.by_pid[entry.pid] = result.by_pid.get(entry.pid, 0) + (entry.used_bytes or 0)
            found = identify(self.proc_root, entry.pid)
            if found is None:
                continue  # exited since the snapshot: its memory is going with it
            identity, owner = found
            seen.add(identity)
            signalled = self.killed.get(identity)
            if signalled is not None and result.at - signalled < self.release_grace_s:
                continue  # already signalled: what the driver still shows is being released
            if owner is None:
                result.unattributed.append(Unattributed(entry.pid, entry.device_uuid, entry.used_bytes, "not in a kubelet container cgroup"))
                continue
            target = targets.get(owner)
            if target is None:
                target = targets[owner] = self.pods.target(owner)
            if isinstance(target, str):
                result.unattributed.append(Unattributed(entry.pid, entry.device_uuid, entry.used_bytes, target))
                continue
            if target.outside_sharing and entry.device_uuid not in shared:
                result.unattributed.append(Unattributed(entry.pid, entry.device_uuid, entry.used_bytes,
                                                        "a pod outside GPU sharing, on a GPU that KAI does not share"))
                continue
            key = (*target.key, entry.device_uuid)
            measures.setdefault(key, Measure(target, entry.device_uuid)).processes.append(
                Held(identity, owner, entry.device_uuid, entry.used_bytes))
        for gone in [i for i in self.killed if i not in seen]:
            del self.killed[gone]  # torn down: the driver no longer shows it
        result.measures = list(measures.values())
        self.pods.forget_except({m.target.key for m in result.measures})
        return result

    def allowance(self, measure: Measure) -> int:
        """The container's allowance for context reservations on the device: one, whatever its process
        count, and none where it was granted nothing (it has no business with a context there)."""
        return self.tolerance_bytes if measure.limit_bytes > 0 else 0

    def threshold(self, measure: Measure) -> int:
        return measure.limit_bytes + self.allowance(measure)

    async def _judge(self, result: Poll) -> None:
        live = set()
        self.acted = False
        for measure in result.measures:
            key = (*measure.target.key, measure.device_uuid)
            live.add(key)
            episode = self.episodes.setdefault(key, _Episode())
            if not measure.complete:
                episode.over = 0  # a withheld figure: never act on part of the truth
                continue
            if measure.used_bytes <= self.threshold(measure):
                self.episodes[key] = _Episode()  # under again: the episode (and its breach) is over
                continue
            episode.over += 1
            if episode.over < self.polls_to_breach or (episode.breach is not None and self.on_breach != "kill"):
                continue
            episode.breach = await self._act(measure, result.at)
            self.acted = True
            result.breaches.append((measure.target, episode.breach))
            try:
                await self.report(measure.target, episode.breach)
            except Exception:  # noqa: BLE001 - a report that failed must not stop the next action
                log.exception("could not report a breach", extra={"pod": f"{measure.target.pod.namespace}/{measure.target.pod.name}"})
        for key in [k for k in self.episodes if k not in live]:
            del self.episodes[key]  # nothing of that container on that device any more
        for container, times in list(self.strikes.items()):
            if not (kept := [t for t in times if result.at - t < self.escalate_window_s]):
                del self.strikes[container]
            else:
                self.strikes[container] = kept
        for uid in [u for u, at in self.evicted.items() if result.at - at >= self.escalate_window_s]:
            del self.evicted[uid]

    async def _act(self, measure: Measure, now: float) -> Breach:
        target = measure.target
        ordered = sorted(measure.processes, key=lambda p: (-(p.used_bytes or 0), p.identity.pid))
        breach_id = hashlib.sha256(repr((target.pod.uid, target.container, target.container_id, measure.device_uuid,
                                         sorted((p.identity.pid, p.identity.start_time) for p in ordered))).encode()).hexdigest()[:16]
        killed: set[int] = set()
        action: BreachAction = {"kill": "killed", "evict": "evicted", "warn": "warned"}[self.on_breach]  # type: ignore[assignment]
        ok = True
        if self.on_breach == "kill":
            remaining = measure.used_bytes
            for process in ordered:
                if remaining <= self.threshold(measure):
                    break
                outcome = await asyncio.to_thread(kill_verified, self.proc_root, process.identity, process.owner)
                log.warning("breach: %s pid %d", outcome, process.identity.pid, extra={
                    "pod": f"{target.pod.namespace}/{target.pod.name}", "container": target.container, "device": measure.device_uuid})
                if outcome in ("killed", "gone"):
                    self.killed[process.identity] = now
                    remaining -= process.used_bytes or 0
                if outcome == "killed":
                    killed.add(process.identity.pid)
            ok = remaining <= self.threshold(measure)
            # Killing that does not keep the container under (a relay, bursts, memory never released):
            # the pod goes, once per window.
            strikes = self.strikes.setdefault(target.key, [])
            strikes.append(now)
            if len(strikes) >= self.escalate_after and target.pod.uid not in self.evicted:
                self.evicted[target.pod.uid] = now
                action = "evicted"
                ok = self.evict is not None and await self.evict(target.pod)
        elif self.on_breach == "evict":
            ok = self.evict is not None and await self.evict(target.pod)
        return Breach(
            breach_id=breach_id, device_uuid=measure.device_uuid, grant_bytes=measure.limit_bytes,
            tolerance_bytes=self.allowance(measure), measured_bytes=measure.used_bytes,
            processes=[BreachedProcess(pid=p.identity.pid, used_bytes=p.used_bytes or 0, killed=p.identity.pid in killed) for p in ordered],
            action=action, action_ok=ok,
        )

    def next_poll_in(self, interval_s: float, took_s: float) -> float:
        """Seconds to the next round: after a poll that acted (or one over that waits for confirmation)
        the next comes after a quarter interval, for a relay taking the memory or a kill not yet released.

        Each gap is drawn at random between half and one and a half of that (the same mean): with a
        fixed period, bursts whose period divides it sample the same phase on every poll, and a
        tenant whose bursts sit between polls is never seen; at random times each poll sees a burst
        held a fraction d of the time with probability d, whatever its period."""
        pending = self.acted or any(e.over and e.breach is None for e in self.episodes.values())
        base = interval_s / 4 if pending else interval_s
        return max(0.0, base * _JITTER.uniform(0.5, 1.5) - took_s)

    async def run(self, interval_s: float) -> None:
        """Poll every `interval_s` until cancelled; a failed round is logged and the next one retries."""
        while True:
            began = time.monotonic()
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - the enforcer must keep running
                log.exception("enforcer round failed")
            await asyncio.sleep(self.next_poll_in(interval_s, time.monotonic() - began))


# --- what a breach tells the world -----------------------------------------------------------------


def verdict(node: str, target: Target, breach: Breach) -> HealthVerdict:
    """The `breached` verdict: which device, the grant, what the driver measured, the processes, the action."""
    pids = ",".join(f"{p.pid}({p.used_bytes >> 20} MiB)" for p in breach.processes)
    killed = ",".join(str(p.pid) for p in breach.processes if p.killed)
    done = {"killed": f"killed pids {killed or 'none'}", "evicted": "evicted the pod", "warned": "warned only (--on-breach warn)"}[breach.action]
    if breach.action == "evicted" and killed:
        done = f"killed pids {killed}; killing does not keep the container under its grant: evicted the pod"
    granted = f"grant {breach.grant_bytes} bytes (+{breach.tolerance_bytes} for driver context reservations)"
    if target.withheld:
        granted = f"held to 0 bytes: {target.withheld}"
    reasons = [
        Reason(code="over-grant", message=f"device {breach.device_uuid}: the driver shows {breach.measured_bytes} bytes held by pids {pids}, "
                                          f"{granted}"),
        Reason(code=breach.action, message=done if breach.action_ok else f"{done}: not carried out in full"),
    ]
    return HealthVerdict(pod=target.pod, node_name=node, container=target.container or f"id:{target.container_id[:12]}",
                         verdict="breached", reasons=reasons, observation=f"breach-{breach.breach_id}", breach=breach)


def event_message(target: Target, breach: Breach) -> str:
    report = verdict("", target, breach)
    return f"container {report.container}: breached (" + "; ".join(f"{r.code}: {r.message}" for r in report.reasons) + ")"


def driver_memory(poll: Poll | None, fresh_s: float) -> dict[int, int] | None:
    """Host pid -> device memory the driver showed in the latest complete poll, if recent enough."""
    if poll is None or not poll.ok or time.monotonic() - poll.at > fresh_s:
        return None
    return poll.by_pid


def driver_devices(enforcer: Enforcer | None, pod_uid: str, container: str, fresh_s: float) -> list[DriverDeviceUsage] | None:
    """The container's total on each device in the enforcer's latest complete poll (if recent enough),
    with what it is held to: the grant (0 where none) and the container's allowance."""
    poll = enforcer.last if enforcer is not None else None
    if enforcer is None or poll is None or driver_memory(poll, fresh_s) is None:
        return None
    return [DriverDeviceUsage(uuid=m.device_uuid, used_bytes=m.used_bytes, grant_bytes=m.limit_bytes, allowance_bytes=enforcer.allowance(m))
            for m in poll.measures if m.target.key == (pod_uid, container) and m.complete]


def with_driver_view(reply: InspectReply, memory: dict[int, int] | None, devices: list[DriverDeviceUsage] | None = None) -> InspectReply:
    """An InspectReply with each process's device memory from the driver (0 for a process it does not list)
    and the container's total on each device against its grant."""
    if memory is None:
        return reply
    processes = [p.model_copy(update={"device_memory_bytes": memory.get(p.pid, 0)}) for p in reply.processes]
    return reply.model_copy(update={"processes": processes, "driver_view": True, "driver_devices": devices or []})

