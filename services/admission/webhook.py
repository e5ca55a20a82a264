"""One admission decision: AdmissionReview bytes in; the HTTP answer and a record of what was decided out."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from kai_isolator.shared.events import AdmissionOutcome

from . import review
from .answer import JSON, TEXT, Answer, DecisionRecord, allowed, bad_request, denied, errored
from .injection import Desired, InjectionConfig, Shapes
from .mutation import CleanPatches, carries_nothing_of_ours, plan_ops, readiness_gate_ops, required_plugin_ops
from .pod import (
    INJECT_ANNOTATION, NoTargetContainer, PodUnreadable, PodView, Target, annotations_of, asks_opt_out, changed_gpu_groups,
    changed_gpu_requests, find_target, is_gpu_sharing, read_pod,
)
from .policy import device_access_findings, findings, judge
from .replay import Replays
from .review import AdmissionRequest, BadReview
from .settings import AdmissionSettings, PolicyMode

__all__ = ["JSON", "TEXT", "Answer", "DecisionRecord", "Webhook", "bad_request", "pod_name_of"]

log = logging.getLogger(__name__)


def pod_name_of(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(metadata, dict):
        return ""
    name = metadata.get("name") or metadata.get("generateName") or ""
    return name if isinstance(name, str) else ""


class Webhook:
    """The decision logic, free of HTTP and of the bus. With `readiness_gate`, an injected pod also
    waits for the verifier's `kai-resource-isolator.io/Isolated` condition before it is Ready."""

    def __init__(self, config: InjectionConfig, mode: PolicyMode, readiness_gate: bool = False, required_plugin: str = "") -> None:
        self.config = config
        self.mode = mode
        self.readiness_gate = readiness_gate
        self.required_plugin = required_plugin  # the NRI plugin a GPU-sharing pod's containers need; "" = none
        self.shapes = Shapes(config)
        self.clean_patches = CleanPatches()
        self.replays = Replays()

    @classmethod
    def from_settings(cls, settings: AdmissionSettings, readiness_gate: bool = False) -> Webhook:
        config = InjectionConfig(settings.container_vgpu_mount, settings.state_dir, settings.allow_pod_opt_out, settings.grant_dir)
        return cls(config, settings.policy, readiness_gate, settings.require_nri_plugin)

    def handle(self, raw: bytes) -> Answer:
        fitted = self.replays.match(raw)
        if fitted is not None and fitted[0].verified:
            return fitted[0].replay(fitted[1])
        try:
            request = review.parse(raw)
        except BadReview as error:
            return bad_request(str(error))
        try:
            answer = self.decide(request)
        except Exception as error:  # noqa: BLE001 - a webhook bug must still answer, never hang or drop
            log.exception("admission failed", extra={"uid": request.uid, "namespace": request.namespace})
            message = f"kai-resource-isolator webhook error: {type(error).__name__}"
            record = DecisionRecord(request.uid, request.namespace, pod_name_of(request.object), "denied", message, dry_run=request.dry_run)
            return Answer(200, errored(request.uid, message, request.api_version), JSON, record)
        self.replays.learn(raw, request, answer, fitted)
        return answer

    def decide(self, request: AdmissionRequest) -> Answer:
        pod = request.object
        if request.kind != "Pod" or request.group:
            return _allow(request, f"not a Pod ({request.group + '/' if request.group else ''}{request.kind or 'unknown kind'})")
        if request.operation == "UPDATE":
            return self._judge_update(request)
        if request.operation != "CREATE":
            return _allow(request, f"operation {request.operation} is not mutated")
        warnings: list[str] = []
        try:
            annotations = annotations_of(pod)
            if not is_gpu_sharing(annotations):
                return self._judge_device_access(request, annotations)
            if asks_opt_out(annotations):
                if self.config.allow_pod_opt_out:
                    return _allow(request, f"opted out by annotation {INJECT_ANNOTATION}")
                warnings.append(f"kai-resource-isolator: annotation {INJECT_ANNOTATION} is ignored: pod opt-out is disabled")
            view = read_pod(pod, annotations)
            target = find_target(view)
            desired = self.shapes.desired(target)
            found = findings(view, target, desired, self.config)
            verdict = judge(found, self.mode)
            if not verdict.allowed:
                return _deny(request, 403, verdict.message, container=target.name, found=found)
            patch_json, operations = self._patch(view, target, desired)
        except PodUnreadable as error:
            return _deny(request, 400, f"cannot read pod: {error}")
        except NoTargetContainer as error:
            return _deny(request, 400, str(error))
        warnings += verdict.warnings
        decision: AdmissionOutcome = "warned" if verdict.warnings else "injected" if operations else "skipped"
        reason = f"libvgpu injected into {target.field}[{target.index}]" if operations else "already injected"
        if verdict.warnings:
            reason += f"; {len(found)} policy finding(s)"
        body = allowed(request, warnings=warnings, patch_json=patch_json)
        return _answer(request, body, decision, reason, target.name, found, operations)

    def _judge_device_access(self, request: AdmissionRequest, annotations: dict[str, str]) -> Answer:
        """A pod outside GPU sharing is not mutated; under the policy, a container of it that names GPUs for the NVIDIA
        runtime without asking the device plugin for one is refused (enforce) or warned about (warn). The webhook's
        matchConditions send it only such pods, and only at creation."""
        if self.mode == "off":
            return _allow(request, "not a GPU-sharing pod (no gpu-fraction or gpu-memory annotation)")
        try:
            found = device_access_findings(read_pod(request.object, annotations))
        except PodUnreadable as error:
            return _deny(request, 400, f"cannot read pod: {error}")
        if not found:
            return _allow(request, "not a GPU-sharing pod (no gpu-fraction or gpu-memory annotation)")
        verdict = judge(found, self.mode, "this pod, which shares no GPU")
        if not verdict.allowed:
            return _deny(request, 403, verdict.message, found=found)
        return _answer(request, allowed(request, warnings=verdict.warnings), "warned",
                       f"not a GPU-sharing pod; {len(found)} policy finding(s)", found=found)

    def _judge_update(self, request: AdmissionRequest) -> Answer:
        """An update may change anything of a pod but what KAI booked its GPU share from and named its ConfigMaps by,
        and, once the pod is bound, the GPU groups KAI placed it in: the node computes the grant from those, so a tenant
        that edited them after scheduling would grant itself more than was booked, or another GPU than KAI reserved.
        Refused under every policy mode, as the API server refuses a change to an immutable field."""
        try:
            if request.old_object is None:
                raise PodUnreadable("an UPDATE review must carry request.oldObject, the pod before the update")
            changed = changed_gpu_requests(annotations_of(request.old_object), annotations_of(request.object))
            regrouped = changed_gpu_groups(request.old_object, request.object)
        except PodUnreadable as error:
            answer = _deny(request, 400, f"cannot read pod: {error}")
        else:
            if changed:
                answer = _deny(request, 422, f"kai-resource-isolator: the GPU-sharing annotations of a pod cannot change once it exists "
                                             f"({'; '.join(changed)}): KAI-Scheduler booked the GPU share from them and the node grants "
                                             "from them; delete the pod and create it again")
            elif regrouped:
                answer = _deny(request, 422, f"kai-resource-isolator: the GPU-group labels of a bound pod cannot change "
                                             f"({'; '.join(regrouped)}): KAI-Scheduler reserved its GPUs for those groups and the node "
                                             "grants those GPUs; delete the pod and create it again")
            else:
                answer = _allow(request, "the update keeps the GPU request")
        return _unpublished(answer)

    def _patch(self, view: PodView, target: Target, desired: Desired) -> tuple[bytes | None, int]:
        """The patch serialised (None when empty) and its length; a pod that carries nothing of ours
        gets the one its shape always gets."""
        gate = readiness_gate_ops(view) if self.readiness_gate else []
        if self.required_plugin:
            gate += required_plugin_ops(view, self.required_plugin)
        if carries_nothing_of_ours(view, target, desired):
            ops_json, operations = self.clean_patches.clean_patch(view, target, desired)
            if gate:  # splice the gate's op onto the array: `[...]` + `,{...}]`
                ops_json = ops_json[:-1] + b"," + orjson.dumps(gate)[1:]
            return ops_json, operations + len(gate)
        ops = plan_ops(view, target, desired) + gate
        return (orjson.dumps(ops) if ops else None), len(ops)


def _answer(request: AdmissionRequest, body: bytes, decision: AdmissionOutcome, reason: str, container: str | None = None,
            found: list[str] | tuple[str, ...] = (), operations: int = 0) -> Answer:
    record = DecisionRecord(request.uid, request.namespace, pod_name_of(request.object), decision, reason, container,
                            tuple(found), operations, request.dry_run)
    return Answer(200, body, JSON, record)


def _unpublished(answer: Answer) -> Answer:
    return answer._replace(record=answer.record and answer.record._replace(published=False))


def _allow(request: AdmissionRequest, reason: str) -> Answer:
    return _answer(request, allowed(request), "skipped", reason)


def _deny(request: AdmissionRequest, code: int, message: str, container: str | None = None,
          found: list[str] | tuple[str, ...] = ()) -> Answer:
    return _answer(request, denied(request, code, message), "denied", message, container, found)
