"""CloudEvents 1.0 envelope (structured JSON mode) and the versioned payload of every event and request.

A payload knows its CloudEvents `type`, the subject it is published on and the id that
de-duplicates it, so publishers never spell any of them.
"""

from __future__ import annotations

import base64
import uuid
from datetime import datetime, timezone
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import subjects
from .errors import DecodeError

SPEC_VERSION = "1.0"
CONTENT_TYPE = "application/cloudevents+json"
TYPE_PREFIX = "io.kai-isolator."


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Payload(BaseModel):
    """Base of every event and request body."""

    # Unknown fields are ignored so a newer producer's additive fields never break an older consumer.
    model_config = ConfigDict(extra="ignore", frozen=True)
    TYPES: ClassVar[tuple[str, ...]]

    @property
    def event_type(self) -> str:
        return self.TYPES[0]

    def subject(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} is not published on a subject")

    def event_subject(self) -> str | None:
        """The CloudEvents `subject` attribute: what the event is about, e.g. `ns/pod`."""
        return None

    def dedup_id(self) -> str:
        """`Nats-Msg-Id` and CloudEvents `id`: equal for two publications of the same fact."""
        return uuid.uuid4().hex


class Envelope(BaseModel):
    """CloudEvents 1.0 attributes, structured JSON mode."""

    model_config = ConfigDict(extra="allow")  # CloudEvents extension attributes
    specversion: Literal["1.0"] = SPEC_VERSION
    id: str = Field(min_length=1)
    source: str = Field(min_length=1)
    type: str = Field(min_length=1)
    subject: str | None = None
    time: datetime = Field(default_factory=utcnow)
    datacontenttype: str = "application/json"
    data: Any = None


# --- shared pieces -----------------------------------------------------------------


class PodRef(BaseModel):
    model_config = ConfigDict(frozen=True)
    namespace: str
    name: str
    uid: str = ""


class Reason(BaseModel):
    """A machine-readable code with a human explanation."""

    model_config = ConfigDict(frozen=True)
    code: str
    message: str = ""


class DeviceUsage(BaseModel):
    model_config = ConfigDict(frozen=True)
    index: int = Field(ge=0)
    uuid: str = ""
    limit_bytes: int = Field(ge=0)
    used_bytes: int = Field(ge=0)
    unlimited: bool = Field(False, description="no limit is set (limit_bytes is then 0 and means nothing)")


class ProcessUsage(BaseModel):
    model_config = ConfigDict(frozen=True)
    pid: int = Field(gt=0)
    device: int = Field(ge=0)
    used_bytes: int = Field(ge=0)


# --- events --------------------------------------------------------------------------

AdmissionOutcome = Literal["injected", "skipped", "denied", "warned"]


class AdmissionDecision(Payload):
    """What the webhook decided for one pod CREATE."""

    TYPES = ("io.kai-isolator.admission.decision.v1",)
    request_uid: str
    namespace: str
    pod_name: str = Field(description="metadata.name, or generateName when the name is not yet set")
    decision: AdmissionOutcome
    reason: str = ""
    container: str | None = None
    findings: list[str] = Field(default_factory=list)
    patch_operations: int = Field(0, ge=0)

    def subject(self) -> str:
        return subjects.admission(self.namespace)

    def event_subject(self) -> str:
        return f"{self.namespace}/{self.pod_name}"

    def dedup_id(self) -> str:
        return f"admission:{self.request_uid}"


PodState = Literal["admitted", "scheduled", "running", "finished", "deleted", "isolation-missing"]


class PodIsolation(Payload):
    """A GPU-sharing pod's isolation story at one resourceVersion."""

    TYPES = tuple(f"io.kai-isolator.pod.{state}.v1" for state in PodState.__args__)  # type: ignore[attr-defined]
    pod: PodRef
    resource_version: str
    state: PodState
    phase: str | None = None
    node_name: str | None = None
    container: str | None = Field(None, description="the fraction container the library targets")
    injected: bool = False
    gpu_fraction: str | None = None
    gpu_memory: str | None = None
    expected_limit: str | None = Field(None, description="CUDA_DEVICE_MEMORY_LIMIT granted by the scheduler")
    reasons: list[Reason] = Field(default_factory=list)

    @property
    def event_type(self) -> str:
        return f"io.kai-isolator.pod.{self.state}.v1"

    def subject(self) -> str:
        return subjects.pod(self.pod.namespace, self.pod.name)

    def event_subject(self) -> str:
        return f"{self.pod.namespace}/{self.pod.name}"

    def dedup_id(self) -> str:
        return f"pod:{self.pod.uid}:{self.resource_version}:{self.state}"


Verdict = Literal["verified", "degraded", "missing", "breached"]
BreachAction = Literal["killed", "evicted", "warned"]
# How a node holds grants, and so how one container is held: the driver's per-cgroup cap (R615+, cgroup v2, NRI), or
# libvgpu.so and the enforcer. The enforcer stays on in both.
HeldBy = Literal["driver-capped", "library-and-enforcer"]


class BreachedProcess(BaseModel):
    """A process of a breaching container as the driver reported it, and what was done to it."""

    model_config = ConfigDict(frozen=True)
    pid: int = Field(gt=0, description="host PID")
    used_bytes: int = Field(ge=0, description="device memory the driver says it holds")
    killed: bool = False


class Breach(BaseModel):
    """A container above its grant on one device, measured by the driver (NVML), and the action taken."""

    model_config = ConfigDict(frozen=True)
    breach_id: str = Field(description="one breach, one id: equal on every report of it")
    device_uuid: str
    grant_bytes: int = Field(ge=0)
    tolerance_bytes: int = Field(ge=0, description="allowance for the driver's per-context reservations")
    measured_bytes: int = Field(ge=0)
    processes: list[BreachedProcess] = Field(default_factory=list)
    action: BreachAction
    action_ok: bool = Field(True, description="the action was carried out (an eviction the API refused is not)")


class HealthVerdict(Payload):
    """A finding for one container at one observation: the verifier's, or the node agent's `breached`."""

    TYPES = ("io.kai-isolator.health.verdict.v1",)
    pod: PodRef
    node_name: str
    container: str
    verdict: Verdict
    reasons: list[Reason] = Field(default_factory=list)
    observation: str = Field(description="digest of what was observed; the same observation is never re-emitted")
    observed_at: datetime = Field(default_factory=utcnow)
    breach: Breach | None = Field(None, description="set on `breached`: what the driver showed and what the node agent did")
    held: HeldBy | None = Field(None, description="how the container is held: the driver's cap read back on its leaf, or the "
                                                  "library and the enforcer; None: not looked at (a verdict without inspection)")

    def subject(self) -> str:
        return subjects.health(self.pod.namespace, self.pod.name)

    def event_subject(self) -> str:
        return f"{self.pod.namespace}/{self.pod.name}"

    def dedup_id(self) -> str:
        return f"health:{self.pod.uid}:{self.container}:{self.observation}"


class NodeStatus(Payload):
    """A node agent's report of what is installed on its node."""

    TYPES = ("io.kai-isolator.node.status.v1",)
    node_name: str
    sequence: int = Field(ge=0, description="per-agent counter; with node_name it identifies the report")
    ready: bool
    active_version: str | None = Field(None, description="sha256 prefix of the library libvgpu.so points at")
    installed_versions: list[str] = Field(default_factory=list)
    container_vgpu_mount: str = "/usr/local/vgpu"
    gpu_count: int = Field(0, ge=0)
    message: str = ""
    self_check: Literal["passed", "failed", "not-run"] = Field("not-run", description="outcome of the last self-check")
    self_check_at: datetime | None = Field(None, description="when the last self-check ran")
    problems: list[str] = Field(default_factory=list)
    enforcer: Literal["off", "enforcing", "blind"] = Field(
        "off", description="enforcing: the driver's view (NVML) is complete; blind: NVML is missing or failing, nothing is acted on")
    enforcer_problem: str = Field("", description="what keeps the enforcer from holding containers to their grants, if anything")
    mode: HeldBy = Field(
        "library-and-enforcer", description="how the node holds grants: the driver's per-cgroup cap set at creation (R615+, cgroup v2, "
                                            "NRI), or the library and the enforcer; the enforcer stays on in both")

    def subject(self) -> str:
        return subjects.node_status(self.node_name)

    def event_subject(self) -> str:
        return self.node_name

    def dedup_id(self) -> str:
        return f"node:{self.node_name}:{self.sequence}"


class UsageReport(Payload):
    """GPU memory use of one container: from the driver (NVML) when the node agent sees it, else its usage cache."""

    TYPES = ("io.kai-isolator.usage.report.v1",)
    pod: PodRef
    node_name: str
    container: str
    devices: list[DeviceUsage] = Field(default_factory=list)
    processes: list[ProcessUsage] = Field(default_factory=list)
    sampled_at: datetime = Field(default_factory=utcnow)
    source: Literal["driver", "usage-cache"] = Field("usage-cache", description="where used_bytes comes from")
    reasons: list[Reason] = Field(default_factory=list, description="e.g. usage-cache-disagrees: the cache is not what the driver shows")

    def subject(self) -> str:
        return subjects.usage(self.pod.namespace, self.pod.name)

    def event_subject(self) -> str:
        return f"{self.pod.namespace}/{self.pod.name}"

    def dedup_id(self) -> str:
        return f"usage:{self.pod.uid}:{self.container}:{self.sampled_at.isoformat()}"


GrantOutcome = Literal["written", "kept", "withheld", "removed"]


class GrantDecision(Payload):
    """What a node agent did about one container's grant (shared/grant.py), and why.

    `written`: grant.json now holds `limit_bytes` on `devices`; `kept`: an earlier grant stays (a later
    computation would have raised it, or could not be made); `withheld`: no grant (the library fails
    closed); `removed`: the pod is gone. `reasons` say why whenever the inputs disagreed or were missing.
    """

    TYPES = ("io.kai-isolator.grant.decision.v1",)
    pod: PodRef
    node_name: str
    container: str
    outcome: GrantOutcome
    source: Literal["configmap", "annotation"] | None = None
    limit_bytes: int | None = Field(None, ge=0)
    devices: list[str] = Field(default_factory=list)
    configmap_limit_bytes: int | None = None
    annotation_limit_bytes: int | None = None
    reasons: list[Reason] = Field(default_factory=list)

    def subject(self) -> str:
        return subjects.grant(self.pod.namespace, self.pod.name)

    def event_subject(self) -> str:
        return f"{self.pod.namespace}/{self.pod.name}"

    def dedup_id(self) -> str:
        codes = ",".join(r.code for r in self.reasons)
        return f"grant:{self.pod.uid}:{self.container}:{self.outcome}:{self.limit_bytes}:{','.join(self.devices)}:{codes}"


RolloutPhase = Literal["progressing", "node-done", "halted", "completed"]


class RolloutProgress(Payload):
    """The rollout driver's progress moving nodes to one library version; `halted` names the node that failed."""

    TYPES = tuple(f"io.kai-isolator.rollout.{phase}.v1" for phase in RolloutPhase.__args__)  # type: ignore[attr-defined]
    rollout_id: str
    version: str
    phase: RolloutPhase
    node_name: str | None = Field(None, description="the node this event is about (node-done, halted)")
    done_nodes: list[str] = Field(default_factory=list)
    pending_nodes: list[str] = Field(default_factory=list)
    message: str = ""

    @property
    def event_type(self) -> str:
        return f"io.kai-isolator.rollout.{self.phase}.v1"

    def subject(self) -> str:
        return subjects.rollout(self.rollout_id)

    def event_subject(self) -> str:
        return self.rollout_id

    def dedup_id(self) -> str:
        return f"rollout:{self.rollout_id}:{self.phase}:{self.node_name or ''}:{len(self.done_nodes)}"


class DeadLetter(Payload):
    """A message a service gave up on, with why."""

    TYPES = ("io.kai-isolator.dlq.letter.v1",)
    service: str
    consumer: str
    original_subject: str
    stream_sequence: int = Field(ge=0)
    deliveries: int = Field(ge=0)
    error: str
    payload_base64: str

    @classmethod
    def of(cls, *, service: str, consumer: str, subject: str, sequence: int, deliveries: int, error: str, raw: bytes) -> DeadLetter:
        return cls(
            service=service, consumer=consumer, original_subject=subject, stream_sequence=sequence,
            deliveries=deliveries, error=error, payload_base64=base64.b64encode(raw).decode(),
        )

    def subject(self) -> str:
        return subjects.dlq(self.service)

    def dedup_id(self) -> str:
        return f"dlq:{self.consumer}:{self.stream_sequence}"


# --- requests and replies ---------------------------------------------------------------


class InspectRequest(Payload):
    """Ask a node agent what a container's processes really have."""

    TYPES = ("io.kai-isolator.node.inspect.request.v1",)
    node_name: str
    pod: PodRef
    container: str
    container_id: str = Field("", description="the runtime's id from status.containerStatuses (any `<runtime>://` prefix); "
                                              "empty: the agent tells the pod's containers apart by their mounts")

    def subject(self) -> str:
        return subjects.node_inspect(self.node_name)


class ProcessReport(BaseModel):
    model_config = ConfigDict(frozen=True)
    pid: int
    preload: str | None = Field(None, description="content of /etc/ld.so.preload as the process sees it")
    preload_ours: bool | None = Field(None, description="/etc/ld.so.preload is the node's file (device and inode); None: not checked")
    library_mapped: bool = Field(False, description="maps the library the node installed (device and inode, never the name)")
    library_version: str | None = None
    library_not_ours: str | None = Field(None, description="path of a mapped file named like the library that is not the node's")
    memory_limit_env: str | None = None
    grant_mounted: bool | None = Field(None, description="sees the node's grant dir at /etc/kai-isolator; None: not checked")
    device_memory_bytes: int | None = Field(None, ge=0, description="device memory the driver (NVML) says it holds, all devices; "
                                                                      "None: the driver's view is unavailable")


class DriverCap(BaseModel):
    """The hard limit the driver holds for a container's cgroup v2 leaf on one device, read back through
    nvmlDeviceGetMemoryLimits_v1 (R615+): an allocation past it fails in the driver."""

    model_config = ConfigDict(frozen=True)
    uuid: str
    hard_bytes: int = Field(ge=0)


class DriverDeviceUsage(BaseModel):
    """A container's total on one device as the driver (NVML) shows it, and what the node holds it to."""

    model_config = ConfigDict(frozen=True)
    uuid: str
    used_bytes: int = Field(ge=0, description="what the container's processes hold on the device, by the driver")
    grant_bytes: int = Field(ge=0, description="the node's grant on the device; 0 where it granted nothing")
    allowance_bytes: int = Field(ge=0, description="the container's allowance for the driver's context reservations")


class InspectReply(Payload):
    TYPES = ("io.kai-isolator.node.inspect.reply.v1",)
    node_name: str
    pod: PodRef
    container: str
    found: bool
    processes: list[ProcessReport] = Field(default_factory=list)
    devices: list[DeviceUsage] = Field(default_factory=list)
    installed_version: str | None = None
    message: str = ""
    usage_cache_tampered: list[str] = Field(default_factory=list, description="what shows the accounting file was tampered with")
    driver_view: bool = Field(False, description="device_memory_bytes of each process comes from the driver (NVML)")
    driver_devices: list[DriverDeviceUsage] = Field(default_factory=list, description="with driver_view: the container's total on "
                                                                                       "each device it holds memory on, against its grant")
    driver_caps: list[DriverCap] = Field(default_factory=list, description="the driver's cap on the container's leaf, read back per "
                                                                          "device; empty: the driver holds none (library-and-enforcer)")


class InstallRequest(Payload):
    """Ask a node agent to activate a library version."""

    TYPES = ("io.kai-isolator.node.install.request.v1",)
    node_name: str
    version: str = Field(min_length=1)
    rollout_id: str = ""

    def subject(self) -> str:
        return subjects.node_install(self.node_name)


class InstallReply(Payload):
    TYPES = ("io.kai-isolator.node.install.reply.v1",)
    node_name: str
    version: str
    ok: bool
    active_version: str | None = None
    message: str = ""


class ErrorReply(Payload):
    """What a request gets back when its handler failed or the request was unreadable."""

    TYPES = ("io.kai-isolator.error.reply.v1",)
    error: str


PAYLOAD_CLASSES: tuple[type[Payload], ...] = (
    AdmissionDecision, PodIsolation, HealthVerdict, NodeStatus, UsageReport, GrantDecision, RolloutProgress, DeadLetter,
    InspectRequest, InspectReply, InstallRequest, InstallReply, ErrorReply,
)
REGISTRY: dict[str, type[Payload]] = {t: cls for cls in PAYLOAD_CLASSES for t in cls.TYPES}


def encode(payload: Payload, source: str) -> bytes:
    """Structured-mode CloudEvent bytes for a payload."""
    envelope = Envelope(
        id=payload.dedup_id(),
        source=source,
        type=payload.event_type,
        subject=payload.event_subject(),
        data=payload.model_dump(mode="json"),
    )
    return envelope.model_dump_json(exclude_none=True).encode()


def decode(raw: bytes) -> tuple[Envelope, Payload]:
    """Validate an envelope and its typed data; DecodeError says what is wrong."""
    try:
        envelope = Envelope.model_validate_json(raw)
    except ValidationError as error:
        raise DecodeError(f"not a CloudEvents 1.0 JSON envelope: {_first(error)}") from None
    model = REGISTRY.get(envelope.type)
    if model is None:
        raise DecodeError(f"unknown event type {envelope.type!r}")
    try:
        payload = model.model_validate(envelope.data)
    except ValidationError as error:
        raise DecodeError(f"invalid {envelope.type} data: {_first(error)}") from None
    if payload.event_type != envelope.type:
        raise DecodeError(f"envelope type {envelope.type!r} disagrees with its data ({payload.event_type!r})")
    return envelope, payload


def _first(error: ValidationError) -> str:
    detail = error.errors()[0]
    where = ".".join(map(str, detail["loc"])) or "body"
    return f"{where}: {detail['msg']} ({error.error_count()} error(s))"
