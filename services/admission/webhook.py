"""One admission decision: AdmissionReview bytes in; the HTTP answer and a record of what was decided out."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kai_isolator.shared.events import AdmissionOutcome

from . import review
from .mutation import (
    INJECT_ANNOTATION, InjectionConfig, NoTargetContainer, PodUnreadable, annotations_of, asks_opt_out,
    desired_for, find_target, is_gpu_sharing, patch_ops, read_pod, readiness_gate_ops,
)
from .policy import findings, judge
from .review import AdmissionRequest, BadReview
from .settings import AdmissionSettings, PolicyMode

log = logging.getLogger(__name__)

JSON = "application/json"
TEXT = "text/plain"


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """What the webhook decided, kept small: the event is built from it off the request path."""

    request_uid: str
    namespace: str
    pod_name: str
    decision: AdmissionOutcome
    reason: str
    container: str | None = None
    findings: tuple[str, ...] = ()
    patch_operations: int = 0


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    content_type: str
    record: DecisionRecord | None = None


def bad_request(message: str) -> Answer:
    return Answer(400, f"{message}\n".encode(), TEXT)


def pod_name_of(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(metadata, dict):
        return ""
    name = metadata.get("name") or metadata.get("generateName") or ""
    return name if isinstance(name, str) else ""


class Webhook:
    """The decision logic, free of HTTP and of the bus. With `readiness_gate`, an injected pod also
    waits for the verifier's `kai-resource-isolator.io/Isolated` condition before it is Ready."""

    def __init__(self, config: InjectionConfig, mode: PolicyMode, readiness_gate: bool = False) -> None:
        self.config = config
        self.mode = mode
        self.readiness_gate = readiness_gate

    @classmethod
    def from_settings(cls, settings: AdmissionSettings, readiness_gate: bool = False) -> Webhook:
        config = InjectionConfig(settings.container_vgpu_mount, settings.state_dir, settings.allow_pod_opt_out, settings.grant_dir)
        return cls(config, settings.policy, readiness_gate)

    def handle(self, raw: bytes) -> Answer:
        try:
            request = review.parse(raw)
        except BadReview as error:
            return bad_request(str(error))
        try:
            return self.decide(request)
        except Exception as error:  # noqa: BLE001 - a webhook bug must still answer, never hang or drop
            log.exception("admission failed", extra={"uid": request.uid, "namespace": request.namespace})
            message = f"kai-resource-isolator webhook error: {type(error).__name__}"
            record = DecisionRecord(request.uid, request.namespace, pod_name_of(request.object), "denied", message)
            return Answer(200, review.errored(request.uid, message, request.api_version), JSON, record)

    def decide(self, request: AdmissionRequest) -> Answer:
        pod = request.object
        record = _Recorder(request, pod_name_of(pod))
        if request.kind != "Pod" or request.group:
            return record.allow(f"not a Pod ({request.group + '/' if request.group else ''}{request.kind or 'unknown kind'})")
        if request.operation != "CREATE":
            return record.allow(f"operation {request.operation} is not mutated")
        warnings: list[str] = []
        try:
            annotations = annotations_of(pod)
            if not is_gpu_sharing(annotations):
                return record.allow("not a GPU-sharing pod (no gpu-fraction or gpu-memory annotation)")
            if asks_opt_out(annotations):
                if self.config.allow_pod_opt_out:
                    return record.allow(f"opted out by annotation {INJECT_ANNOTATION}")
                warnings.append(f"kai-resource-isolator: annotation {INJECT_ANNOTATION} is ignored: pod opt-out is disabled")
            view = read_pod(pod, annotations)
            target = find_target(view)
            desired = desired_for(target, self.config)
            found = findings(view, target, desired, self.config)
            ops = patch_ops(view, target, self.config, desired)
            if self.readiness_gate:
                ops += readiness_gate_ops(view)
        except PodUnreadable as error:
            return record.deny(400, f"cannot read pod: {error}")
        except NoTargetContainer as error:
            return record.deny(400, str(error))
        verdict = judge(found, self.mode)
        if not verdict.allowed:
            return record.deny(403, verdict.message, container=target.name, found=found)
        warnings += verdict.warnings
        decision: AdmissionOutcome = "warned" if verdict.warnings else "injected" if ops else "skipped"
        reason = f"libvgpu injected into {target.field}[{target.index}]" if ops else "already injected"
        if verdict.warnings:
            reason += f"; {len(found)} policy finding(s)"
        return record.answer(review.allowed(request, ops, warnings), decision, reason, target.name, found, len(ops))


class _Recorder:
    """Builds answers and their decision records for one request."""

    def __init__(self, request: AdmissionRequest, pod_name: str) -> None:
        self.request = request
        self.pod_name = pod_name

    def answer(self, body: bytes, decision: AdmissionOutcome, reason: str, container: str | None = None,
               found: list[str] | tuple[str, ...] = (), operations: int = 0) -> Answer:
        r = self.request
        record = DecisionRecord(r.uid, r.namespace, self.pod_name, decision, reason, container, tuple(found), operations)
        return Answer(200, body, JSON, record)

    def allow(self, reason: str) -> Answer:
        return self.answer(review.allowed(self.request), "skipped", reason)

    def deny(self, code: int, message: str, container: str | None = None, found: list[str] | tuple[str, ...] = ()) -> Answer:
        return self.answer(review.denied(self.request, code, message), "denied", message, container, found)
