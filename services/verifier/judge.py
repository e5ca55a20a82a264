"""Compare what a node agent saw in a container with what must be there, and name the verdict.

Pure: the same pod and the same inspection always give the same verdict, reasons and
observation digest, which is what makes verdicts idempotent across retries and restarts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.events import HeldBy, InspectReply, PodIsolation, ProcessReport, Reason, Verdict
from kai_isolator.shared.limits import parse_limit

MISSING_CODES = frozenset({"not-injected", "no-limit-granted", "no-preload", "library-not-loaded"})


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reasons: tuple[Reason, ...]
    held: HeldBy | None = None  # None: judged without a look inside

    @property
    def observation(self) -> str:
        """Digest of the verdict, its reasons and how the container is held: equal observations are one verdict,
        never two, and a container whose node starts or stops capping it is a new one."""
        body = json.dumps([self.verdict, [(r.code, r.message) for r in self.reasons], self.held], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]


def judge_without_inspection(pod: PodIsolation) -> Judgement | None:
    """Verdicts that need no look inside the container; None when one is needed."""
    reasons = []
    if not pod.injected:
        reasons.append(Reason(code="not-injected", message="the pod carries no libvgpu injection (webhook down, skipped or opted out)"))
    if not pod.expected_limit:
        reasons.append(Reason(code="no-limit-granted", message="the scheduler granted no CUDA_DEVICE_MEMORY_LIMIT"))
    return Judgement("missing", tuple(reasons)) if reasons else None


def judge(pod: PodIsolation, reply: InspectReply, library_path: str) -> Judgement:
    """The verdict for an injected, running container from what its node agent observed."""
    up_front = judge_without_inspection(pod)
    if up_front:
        return up_front
    expected = _limit_bytes(pod.expected_limit)
    reasons = [*_preload_reasons(reply, library_path), *_limit_reasons(reply, pod.expected_limit or "", expected), *_usage_reasons(reply, expected)]
    missing = [r for r in reasons if r.code in MISSING_CODES] + _holding_without_library(reply)
    over, held = _driver_over_grant(reply, expected), held_by(reply)
    if over:
        # Whatever the library says, and whatever cap the driver reads back: the driver's usage is the judge.
        return Judgement("breached", tuple(over + missing), held)
    if missing:
        return Judgement("missing", tuple(missing), held)
    return Judgement("degraded" if reasons else "verified", tuple(reasons), held)


def held_by(reply: InspectReply) -> HeldBy:
    """driver-capped where the agent read the driver's cap back on the container's leaf; else the library and the
    enforcer hold it."""
    return "driver-capped" if reply.driver_caps else "library-and-enforcer"


def _driver_over_grant(reply: InspectReply, expected: int | None) -> list[Reason]:
    """From the driver's view: the container's total on a device past what it is held to (the node's grant,
    or the scheduler's limit where that is smaller, plus the container's allowance for contexts)."""
    if not reply.driver_view:
        return []
    found = []
    for device in reply.driver_devices:
        limit = device.grant_bytes if expected is None or device.grant_bytes == 0 else min(device.grant_bytes, expected)
        if device.used_bytes > limit + device.allowance_bytes:
            found.append(Reason(code="driver-over-grant", message=f"device {device.uuid}: the driver shows the container holding "
                                                                  f"{device.used_bytes} bytes, held to {limit} (+{device.allowance_bytes} "
                                                                  "for driver context reservations)"))
    return found


def _holding_without_library(reply: InspectReply) -> list[Reason]:
    """From the driver's view: device memory held by processes that do not map the node's library (by
    identity, so a decoy of the same name counts as none) is memory no limit ever applied to."""
    if not reply.driver_view:
        return []
    holding = {p.pid: p.device_memory_bytes for p in reply.processes if not p.library_mapped and p.device_memory_bytes}
    if not holding:
        return []
    held = ", ".join(f"{pid} ({holding[pid]} bytes)" for pid in sorted(holding))
    return [Reason(code="process-without-library", message=f"the driver shows device memory held by pids {held}, "
                                                          "which do not map libvgpu.so: no limit applies to it")]


def judge_unobservable(pod: PodIsolation, inspections: int, seconds: float) -> Judgement:
    """A Running pod's container in which the node agent found no process, again and again.
    The message names the thresholds, not the counts, so the verdict is one observation."""
    return Judgement("degraded", (Reason(
        code="unobservable",
        message=f"the node agent on {pod.node_name} found no process of container {pod.container} "
                f"in {inspections} inspections over at least {seconds:g}s"),))


def _preload_reasons(reply: InspectReply, library_path: str) -> list[Reason]:
    without_preload = [p.pid for p in reply.processes if not _preload_ok(p, library_path)]
    decoys = {p.pid: p.library_not_ours for p in reply.processes if not p.library_mapped and p.library_not_ours}
    without_library = [p.pid for p in reply.processes if not p.library_mapped and p.pid not in decoys]
    if len(without_preload) == len(reply.processes):
        return [Reason(code="no-preload", message=f"/etc/ld.so.preload is not the node's file naming {library_path} in any process")]
    if len(without_library) == len(reply.processes):
        return [Reason(code="library-not-loaded", message="no process of the container maps libvgpu.so")]
    reasons = []
    if without_preload:
        reasons.append(Reason(code="preload-mismatch", message=f"pids {_pids(without_preload)} see another /etc/ld.so.preload"))
    if decoys:
        paths = ", ".join(sorted(set(decoys.values())))  # type: ignore[arg-type]
        reasons.append(Reason(code="library-not-ours", message=f"pids {_pids(list(decoys))} map {paths}, which is not the node's libvgpu.so"))
    if without_library:
        reasons.append(Reason(code="process-without-library", message=f"pids {_pids(without_library)} do not map libvgpu.so"))
    return reasons


def _preload_ok(process: ProcessReport, library_path: str) -> bool:
    # By identity when the agent checked it: a file of the same content elsewhere is not ours.
    names = library_path in (process.preload or "").split()
    return names and process.preload_ours is not False


def _limit_reasons(reply: InspectReply, granted: str, expected: int | None) -> list[Reason]:
    # A process that sees the node's grant takes its limit from there, whatever its environment says.
    from_env = [p for p in reply.processes if not p.grant_mounted]
    lost = [p.pid for p in from_env if not p.memory_limit_env]
    wrong = [p.pid for p in from_env if p.memory_limit_env and _limit_bytes(p.memory_limit_env) != expected]
    without_grant = [p.pid for p in reply.processes if p.grant_mounted is False]
    reasons = []
    if without_grant:
        reasons.append(Reason(code="limit-from-env", message=f"pids {_pids(without_grant)} see no node-written grant at /etc/kai-isolator: "
                                                            "their limit comes from an environment the tenant controls"))
    if lost:
        reasons.append(Reason(code="limit-env-missing", message=f"pids {_pids(lost)} have no CUDA_DEVICE_MEMORY_LIMIT"))
    if wrong:
        reasons.append(Reason(code="limit-mismatch", message=f"pids {_pids(wrong)} have a CUDA_DEVICE_MEMORY_LIMIT other than the granted {granted}"))
    return reasons


def _usage_reasons(reply: InspectReply, expected: int | None) -> list[Reason]:
    tampered = [Reason(code="usage-cache-tampered", message="; ".join(reply.usage_cache_tampered))] if reply.usage_cache_tampered else []
    if not reply.devices:
        return [*tampered, Reason(code="usage-cache-missing", message="the container's usage cache is absent or unreadable")]
    reasons = tampered
    for device in reply.devices:
        if device.unlimited:
            reasons.append(Reason(code="usage-cache-unlimited", message=f"device {device.index} runs without a limit"))
        elif device.limit_bytes != expected:
            reasons.append(Reason(code="usage-cache-limit-mismatch", message=f"device {device.index} limit {device.limit_bytes} bytes, granted {expected}"))
        if not device.unlimited and device.used_bytes > device.limit_bytes:
            reasons.append(Reason(code="over-limit", message=f"device {device.index} uses {device.used_bytes} of {device.limit_bytes} bytes"))
    return reasons


def _limit_bytes(value: str | None) -> int | None:
    try:
        return parse_limit(value) if value else None
    except ConfigError:
        return None


def _pids(pids: list[int]) -> str:
    return ",".join(map(str, sorted(pids)))
