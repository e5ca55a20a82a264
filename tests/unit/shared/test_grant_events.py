"""The node agent's grant decisions on the bus: their subject, the stream that keeps them, and their identity."""

from __future__ import annotations

from kai_isolator.shared import events as ev
from kai_isolator.shared import subjects

POD = ev.PodRef(namespace="team-a", name="train.v2", uid="u-1")


def decision(**fields: object) -> ev.GrantDecision:
    values: dict[str, object] = {"pod": POD, "node_name": "gpu-node-1", "container": "main", "outcome": "written",
                                 "source": "annotation", "limit_bytes": 4147 << 20, "devices": ["GPU-0"],
                                 "reasons": [ev.Reason(code="limit-disagrees", message="the ConfigMap said more")]}
    return ev.GrantDecision.model_validate({**values, **fields})


def test_grant_decisions_travel_on_their_own_subject_in_the_stream() -> None:
    event = decision()
    assert event.subject() == subjects.grant("team-a", "train.v2") == "isolator.grant.team-a.train_v2"
    assert subjects.parse(event.subject()) == subjects.Subject("grant", namespace="team-a", pod="train.v2")
    assert f"{subjects.ROOT}.grant.>" in subjects.STREAM_SUBJECTS and subjects.ALL_GRANTS == "isolator.grant.>"


def test_a_grant_decision_round_trips_as_a_cloudevent() -> None:
    event = decision()
    envelope, payload = ev.decode(ev.encode(event, "kai-isolator/nodeagent"))
    assert payload == event and envelope.type == "io.kai-isolator.grant.decision.v1" and envelope.id == event.dedup_id()
    assert envelope.subject == "team-a/train.v2"


def test_the_same_decision_has_the_same_id_and_a_different_one_does_not() -> None:
    assert decision().dedup_id() == decision().dedup_id()
    assert decision().dedup_id() != decision(limit_bytes=1 << 30).dedup_id()
    assert decision().dedup_id() != decision(outcome="kept").dedup_id()
    assert decision().dedup_id() != decision(reasons=[]).dedup_id()
    assert decision().dedup_id() != decision(container="helper").dedup_id()
