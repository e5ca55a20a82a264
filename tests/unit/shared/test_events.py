"""Event payloads round-trip through the CloudEvents envelope and read as CloudEvents elsewhere."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from cloudevents.core.formats.json import JSONFormat

from kai_isolator.shared import events as ev
from kai_isolator.shared.errors import DecodeError

POD = ev.PodRef(namespace="team-a", name="train.v2", uid="0b1c")
WHEN = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)

EXAMPLES: list[ev.Payload] = [
    ev.AdmissionDecision(request_uid="r1", namespace="team-a", pod_name="train-", decision="injected", container="main", patch_operations=7),
    *[ev.PodIsolation(pod=POD, resource_version="42", state=state, node_name="gpu-1", expected_limit="4147m", injected=True)
      for state in ("admitted", "scheduled", "running", "finished", "deleted", "isolation-missing")],
    ev.HealthVerdict(pod=POD, node_name="gpu-1", container="main", verdict="degraded",
                     reasons=[ev.Reason(code="process-without-library", message="pid 12")], observation="abc", observed_at=WHEN),
    ev.NodeStatus(node_name="gpu-1", sequence=3, ready=True, active_version="1a2b3c4d", installed_versions=["1a2b3c4d"], gpu_count=1),
    ev.UsageReport(pod=POD, node_name="gpu-1", container="main",
                   devices=[ev.DeviceUsage(index=0, uuid="GPU-1", limit_bytes=4 << 30, used_bytes=1 << 30)],
                   processes=[ev.ProcessUsage(pid=10, device=0, used_bytes=1 << 30)], sampled_at=WHEN),
    ev.DeadLetter.of(service="watcher", consumer="watcher-pods", subject="isolator.pod.a.b", sequence=9, deliveries=5, error="boom", raw=b"\x00"),
    ev.InspectRequest(node_name="gpu-1", pod=POD, container="main"),
    ev.InspectReply(node_name="gpu-1", pod=POD, container="main", found=True,
                    processes=[ev.ProcessReport(pid=5, preload="/usr/local/vgpu/libvgpu.so", library_mapped=True, memory_limit_env="4147m")]),
    ev.InstallRequest(node_name="gpu-1", version="1a2b3c4d", rollout_id="r7"),
    ev.InstallReply(node_name="gpu-1", version="1a2b3c4d", ok=True, active_version="1a2b3c4d"),
    ev.ErrorReply(error="bad request"),
]


@pytest.mark.parametrize("payload", EXAMPLES, ids=lambda p: p.event_type)
def test_payload_round_trips_through_the_envelope(payload: ev.Payload) -> None:
    envelope, decoded = ev.decode(ev.encode(payload, "kai-isolator/test"))
    assert decoded == payload and type(decoded) is type(payload)
    assert envelope.type == payload.event_type and envelope.type.startswith(ev.TYPE_PREFIX)
    if type(payload).dedup_id is not ev.Payload.dedup_id:  # a fact-derived id travels as the CloudEvents id
        assert envelope.id == payload.dedup_id()


@pytest.mark.parametrize("payload", EXAMPLES, ids=lambda p: p.event_type)
def test_the_cloudevents_sdk_reads_our_envelope(payload: ev.Payload) -> None:
    raw = ev.encode(payload, "kai-isolator/test")
    event = JSONFormat().read(None, raw)
    assert event.get_type() == payload.event_type
    assert event.get_source() == "kai-isolator/test"
    assert event.get_data() == payload.model_dump(mode="json")


def test_every_event_type_is_registered_once_and_versioned() -> None:
    types = [t for cls in ev.PAYLOAD_CLASSES for t in cls.TYPES]
    assert len(types) == len(set(types)) == len(ev.REGISTRY)
    assert all(t.endswith(".v1") for t in types)


def test_dedup_ids_identify_the_fact_not_the_publication() -> None:
    a = ev.PodIsolation(pod=POD, resource_version="42", state="running")
    assert a.dedup_id() == ev.PodIsolation(pod=POD, resource_version="42", state="running").dedup_id()
    assert a.dedup_id() != ev.PodIsolation(pod=POD, resource_version="43", state="running").dedup_id()
    assert a.dedup_id() != ev.PodIsolation(pod=POD, resource_version="42", state="deleted").dedup_id()


def test_unknown_fields_from_a_newer_producer_are_ignored() -> None:
    raw = ev.encode(ev.ErrorReply(error="x"), "s").replace(b'"error":"x"', b'"error":"x","hint":"new"')
    assert ev.decode(raw)[1] == ev.ErrorReply(error="x")


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"", "not a CloudEvents 1.0 JSON envelope"),
        (b"[]", "not a CloudEvents 1.0 JSON envelope"),
        (b'{"specversion":"1.0","id":"","source":"s","type":"t"}', "id"),
        (b'{"specversion":"1.0","id":"1","source":"s","type":"io.kai-isolator.error.reply.v1","data":{}}', "error: Field required"),
        (b'{"specversion":"1.0","id":"1","source":"s","type":"io.kai-isolator.pod.running.v1","data":'
         b'{"pod":{"namespace":"a","name":"b"},"resource_version":"1","state":"deleted"}}', "disagrees"),
    ],
)
def test_bad_envelopes_raise_a_clear_decode_error(raw: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        ev.decode(raw)
