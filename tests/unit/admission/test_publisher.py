"""The decision event as the publisher writes it is the one `shared.events.encode` writes for the same
decision, and a full buffer drops, counts and logs without ever waiting."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from kai_isolator.services.admission.answer import DecisionRecord
from kai_isolator.services.admission.publisher import DecisionPublisher, PublishCounters, encode_decision
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import DecodeError
from kai_isolator.shared.events import AdmissionDecision, decode, encode
from kai_isolator.shared.settings import BusSettings

RECORDS = [
    DecisionRecord("u-1", "team-a", "train-0", "injected", "libvgpu injected into containers[0]", "main", (), 9),
    DecisionRecord("u-2", "team.b", "", "denied", "cannot read pod: spec is missing or not an object"),
    DecisionRecord("u-3", "team-c", "p", "warned", "libvgpu injected; 2 policy finding(s)", "app", ("one", "two"), 5),
]


@pytest.mark.parametrize("record", RECORDS)
def test_the_event_is_the_models_own(record: DecisionRecord) -> None:
    model = AdmissionDecision(**record._asdict() | {"findings": list(record.findings)})
    subject, msg_id, data = encode_decision(record, "admission")
    envelope, payload = decode(data)
    expected_envelope, expected_payload = decode(encode(model, "admission"))
    assert (subject, msg_id) == (model.subject(), model.dedup_id())
    assert payload == expected_payload
    assert envelope.model_dump(exclude={"time"}) == expected_envelope.model_dump(exclude={"time"})


def test_a_namespace_no_subject_can_carry_is_refused() -> None:
    with pytest.raises(DecodeError):
        encode_decision(RECORDS[0]._replace(namespace="Not A Name"), "admission")


def counters() -> PublishCounters:
    registry = CollectorRegistry()
    dropped = Counter("dropped", "", ["reason"], registry=registry)
    return PublishCounters(Counter("published", "", registry=registry),
                           {k: dropped.labels(k) for k in ("queue_full", "no_bus", "publish_failed", "unroutable")})


async def test_a_full_buffer_drops_counts_and_logs_once_in_a_while(caplog: pytest.LogCaptureFixture) -> None:
    runtime = Runtime("admission", BusSettings(nats_url="nats://127.0.0.1:1"))  # never started: the bus is not up
    publisher = DecisionPublisher(runtime, kept := counters(), capacity=3, window=2)
    with caplog.at_level(logging.WARNING):
        for _ in range(10):
            publisher.offer(RECORDS[0])
    assert publisher.pending == 3
    assert kept.dropped["queue_full"]._value.get() == 7
    assert len([r for r in caplog.records if "buffer full" in r.getMessage()]) == 1


def test_without_a_bus_every_decision_is_counted_as_dropped() -> None:
    publisher = DecisionPublisher(None, kept := counters(), capacity=3, window=2)
    for record in RECORDS:
        publisher.offer(record)
    assert publisher.pending == 0 and kept.dropped["no_bus"]._value.get() == 3
