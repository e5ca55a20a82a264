"""Subscribers built on the last release keep working: the current schemas only add to the kept ones, or bump the version."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import Field, create_model

from kai_isolator.shared import event_compat, event_contract, events, subjects
from kai_isolator.shared.events import REGISTRY, HealthVerdict, Payload, PodRef, Reason
from support.contract import EVENTS, contract_tools

V1 = "io.kai-isolator.health.verdict.v1"
V2 = "io.kai-isolator.health.verdict.v2"

# HealthVerdict's fields as released in 0.1.0; each case below changes one thing.
RELEASED_FIELDS: dict[str, Any] = {
    "pod": (PodRef, ...),
    "node_name": (str, ...),
    "container": (str, ...),
    "verdict": (Literal["verified", "degraded", "missing"], ...),
    "reasons": (list[Reason], Field(default_factory=list)),
    "observation": (str, ...),
    "observed_at": (datetime, Field(default_factory=datetime.now)),
}


def verdict_schema(event_type: str = V1, **changes: Any) -> dict[str, Any]:
    fields = {name: spec for name, spec in {**RELEASED_FIELDS, **changes}.items() if spec is not None}
    model = create_model("HealthVerdict", __base__=Payload, **fields)
    model.TYPES = (event_type,)
    return event_contract.event_schema(event_type, model)


def breaks(current: dict[str, dict[str, Any]]) -> list[str]:
    return event_compat.breaking_changes({V1: verdict_schema()}, current)


def test_the_current_schemas_keep_every_promise_of_the_last_release() -> None:
    release = event_compat.latest_release(EVENTS / "released")
    assert release is not None and (release / f"{V1}.json").is_file(), "docs/events/released/<version>/ keeps each release's schemas"
    current = {t: event_contract.event_schema(t) for t in REGISTRY}
    problems = event_compat.breaking_changes(event_compat.load_schemas(release), current)
    assert problems == [], (
        f"these changes break subscribers built on release {release.name}:\n  " + "\n  ".join(problems)
        + "\nadd fields as optional, or publish the changed payload under a new type version (.v1 -> .v2)")


def test_the_cases_below_start_from_the_released_shape_of_the_real_model() -> None:
    assert breaks({V1: event_contract.event_schema(V1)}) == []
    assert breaks({V1: verdict_schema()}) == []


@pytest.mark.parametrize(("changes", "expected"), [
    ({"observation": None}, f"{V1}: data.observation: field removed"),
    ({"container": (int, ...)}, f"{V1}: data.container: type changed from string to integer"),
    ({"node_name": (str | None, None)}, f"{V1}: data.node_name: type changed from string to null | string"),
    ({"observed_at": (str, "")}, f"{V1}: data.observed_at: type changed from string (date-time) to string"),
    ({"reasons": (list[str], Field(default_factory=list))}, f"{V1}: data.reasons[]: type changed from object to string"),
    ({"severity": (str, ...)}, f"{V1}: data.severity: new field is required"),
    ({"reasons": (list[Reason], ...)}, f"{V1}: data.reasons: field became required"),
    ({"verdict": (Literal["verified", "degraded"], ...)}, f'{V1}: data.verdict: enumeration value(s) "missing" removed'),
    ({"verdict": (str, ...)}, f'{V1}: data.verdict: type changed from string enum ["verified", "degraded", "missing"] to string'),
    ({"pod": (create_model("PodRef", namespace=(str, ...), name=(str, ...)), ...)}, f"{V1}: data.pod.uid: field removed"),
])
def test_a_change_that_breaks_subscribers_is_named(changes: dict[str, Any], expected: str) -> None:
    assert breaks({V1: verdict_schema(**changes)}) == [expected]


@pytest.mark.parametrize("changes", [
    {"breach_bytes": (int | None, None)},  # a new optional field
    {"verdict": (Literal["verified", "degraded", "missing", "breached"], ...)},  # a new enumeration value
    {"observation": (str, Field(description="reworded"))},  # documentation only
    {"reasons": (list[Reason], Field(default_factory=list, max_length=50))},  # a constraint, not a type
])
def test_additive_changes_pass(changes: dict[str, Any]) -> None:
    assert breaks({V1: verdict_schema(**changes)}) == []


def test_a_new_event_type_passes() -> None:
    assert breaks({V1: verdict_schema(), "io.kai-isolator.grant.issued.v1": verdict_schema("io.kai-isolator.grant.issued.v1")}) == []


def test_a_breaking_change_under_a_new_version_passes_and_dropping_the_type_without_one_does_not() -> None:
    retyped = verdict_schema(V2, container=(int, ...), observation=None)
    assert breaks({V2: retyped}) == []
    assert breaks({V1: verdict_schema(), V2: retyped}) == []  # both versions published during a migration
    assert breaks({}) == [f"{V1}: event type removed (publish it until subscribers moved to a new version)"]
    assert breaks({"io.kai-isolator.health.verdict.v0": retyped}) == [f"{V1}: event type removed (publish it until subscribers moved to a new version)"]


def test_the_command_line_check_reports_breaks_and_exits_non_zero(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    released, current = tmp_path / "released", tmp_path / "current"
    released.mkdir()
    current.mkdir()
    (released / f"{V1}.json").write_text(json.dumps(verdict_schema()))
    (current / f"{V1}.json").write_text(json.dumps(verdict_schema(container=(int, ...))))
    assert event_compat.main([str(released), str(current)]) == 1
    out = capsys.readouterr().out
    assert "data.container: type changed from string to integer" in out and "1 breaking change(s)" in out
    (current / f"{V1}.json").write_text(json.dumps(verdict_schema()))
    assert event_compat.main([str(released), str(current)]) == 0


def test_the_latest_release_is_chosen_by_version_not_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for version in ("0.9.0", "0.10.0", "0.2.1"):
        (tmp_path / version).mkdir()
    assert event_compat.latest_release(tmp_path).name == "0.10.0"  # type: ignore[union-attr]
    assert event_compat.latest_release(tmp_path / "none") is None


@pytest.mark.timeout(600)
def test_what_others_add_lands_in_the_contract_and_passes_every_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A new subject and event type, a new verdict value and a new optional field: regenerate, and all checks pass."""

    def quota(namespace: str, name: str) -> str:
        return f"{subjects.ROOT}.quota.{subjects.encode_token(namespace)}.{subjects.encode_token(name)}"

    quota.__module__ = subjects.__name__

    class QuotaIssued(Payload):
        """A quota was set for a container."""

        TYPES = ("io.kai-isolator.quota.issued.v1",)
        pod: PodRef
        limit_bytes: int = Field(ge=0)

        def subject(self) -> str:
            return quota(self.pod.namespace, self.pod.name)

    class HealthVerdictWithBreach(HealthVerdict):
        verdict: Literal["verified", "degraded", "missing", "breached"]  # type: ignore[assignment]
        breach_bytes: int | None = None

    monkeypatch.setattr(subjects, "quota", quota, raising=False)
    monkeypatch.setattr(subjects, "STREAM_SUBJECTS", (*subjects.STREAM_SUBJECTS, f"{subjects.ROOT}.quota.>"))
    classes = tuple(HealthVerdictWithBreach if c is HealthVerdict else c for c in events.PAYLOAD_CLASSES)
    monkeypatch.setattr(events, "PAYLOAD_CLASSES", (*classes, QuotaIssued))
    monkeypatch.setitem(REGISTRY, V1, HealthVerdictWithBreach)
    monkeypatch.setitem(REGISTRY, QuotaIssued.TYPES[0], QuotaIssued)

    assert "schemas/io.kai-isolator.quota.issued.v1.json" in event_contract.stale_files(EVENTS)  # the checked-in copy asks for `make contract`
    contract = tmp_path / "events"
    event_contract.write(contract)
    release = event_compat.latest_release(EVENTS / "released")
    assert release is not None
    assert event_compat.breaking_changes(event_compat.load_schemas(release), event_compat.load_schemas(contract / "schemas")) == []

    doc = yaml.safe_load((contract / "asyncapi.yaml").read_text())
    assert doc["channels"]["quota"]["address"] == "isolator.quota.{ns}.{pod}"
    assert [m["$ref"] for m in doc["operations"]["publish_quota"]["messages"]] == ["#/channels/quota/messages/io.kai-isolator.quota.issued.v1"]
    assert "breached" in json.dumps(doc["components"]["schemas"]["HealthVerdictWithBreach"])
    result = subprocess.run([*contract_tools().validate_asyncapi, str(contract / "asyncapi.yaml")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
