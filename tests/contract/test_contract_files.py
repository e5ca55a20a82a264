"""The checked-in event contract (docs/events) matches the code, is valid JSON Schema and AsyncAPI, and describes real events."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kai_isolator.shared import event_contract, subjects
from kai_isolator.shared.events import REGISTRY, HealthVerdict, PodIsolation, PodRef, Reason, encode
from support.contract import EVENTS, SCHEMAS, contract_tools


def validator(event_type: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{event_type}.json").read_text())
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_the_checked_in_contract_is_what_the_code_generates() -> None:
    stale = event_contract.stale_files(EVENTS)
    assert not stale, (
        f"docs/events is out of date with shared/events.py and shared/subjects.py: {', '.join(stale)}. "
        f"Regenerate it with `{event_contract.REGENERATE}` and commit the result."
    )


def test_the_generator_finds_and_fixes_every_kind_of_stale_file(tmp_path: Path) -> None:
    contract = tmp_path / "events"
    shutil.copytree(EVENTS, contract, ignore=shutil.ignore_patterns("node_modules", "examples", "validate", "released"))
    edited = contract / "schemas" / "io.kai-isolator.health.verdict.v1.json"
    edited.write_text(edited.read_text().replace('"missing"', '"absent"'))
    (contract / "schemas" / "io.kai-isolator.usage.report.v1.json").unlink()
    (contract / "schemas" / "io.kai-isolator.gone.v1.json").write_text("{}")
    out: list[str] = []

    assert event_contract.main(["--check", str(contract)], out.append) == 1
    assert sorted(line.rsplit("/", 1)[1] for line in out) == sorted(
        ["io.kai-isolator.health.verdict.v1.json", "io.kai-isolator.usage.report.v1.json", "io.kai-isolator.gone.v1.json"])
    assert all(line.startswith("out of date: ") for line in out)

    out.clear()
    assert event_contract.main([str(contract)], out.append) == 0
    assert f"removed {contract / 'schemas' / 'io.kai-isolator.gone.v1.json'}" in out
    assert event_contract.stale_files(contract) == []
    assert edited.read_text() == (SCHEMAS / edited.name).read_text()


def test_there_is_one_schema_per_event_type_and_each_is_valid_json_schema() -> None:
    assert sorted(p.stem for p in SCHEMAS.glob("*.json")) == sorted(REGISTRY)
    for path in SCHEMAS.glob("*.json"):
        schema = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["type"]["const"] == path.stem


@pytest.mark.parametrize("event_type", sorted(REGISTRY))
def test_every_event_type_as_encoded_by_the_services_matches_its_schema(event_type: str) -> None:
    model = REGISTRY[event_type]
    payload = event_contract.sample_payload(model)
    if payload.event_type != event_type:  # one model, several types: the type follows a Literal field
        token = event_type.split(".")[-2]
        field = next(name for name, f in model.model_fields.items() if token in typing.get_args(f.annotation))
        payload = payload.model_copy(update={field: token})
    assert payload.event_type == event_type
    message = json.loads(encode(payload, "test"))
    errors = [e.message for e in validator(event_type).iter_errors(message)]
    assert errors == []


def verdict_message(**data: Any) -> dict[str, Any]:
    verdict = HealthVerdict(pod=PodRef(namespace="default", name="p", uid="u1"), node_name="n", container="main",
                            verdict="degraded", reasons=[Reason(code="limit-mismatch")], observation="abc")
    message = json.loads(encode(verdict, "verifier"))
    message["data"].update(data)
    return message


@pytest.mark.parametrize(("change", "complaint"), [
    (lambda m: m["data"].update(verdict="breached-maybe"), "is not one of"),
    (lambda m: m["data"].pop("container"), "'container' is a required property"),
    (lambda m: m["data"]["reasons"].append({"message": "no code"}), "'code' is a required property"),
    (lambda m: m["data"].update(observed_at="yesterday"), "is not a 'date-time'"),
    (lambda m: m.update(type="io.kai-isolator.pod.running.v1"), "was expected"),
    (lambda m: m.update(specversion="0.3"), "was expected"),
    (lambda m: m.pop("id"), "'id' is a required property"),
])
def test_a_message_that_breaks_the_contract_is_rejected_with_the_reason(change: Any, complaint: str) -> None:
    message = verdict_message()
    assert list(validator("io.kai-isolator.health.verdict.v1").iter_errors(message)) == []
    change(message)
    errors = [e.message for e in validator("io.kai-isolator.health.verdict.v1").iter_errors(message)]
    assert any(complaint in e for e in errors), errors


def test_the_type_of_a_pod_event_pins_its_state() -> None:
    event = PodIsolation(pod=PodRef(namespace="default", name="p", uid="u1"), resource_version="7", state="running")
    message = json.loads(encode(event, "watcher"))
    assert list(validator("io.kai-isolator.pod.running.v1").iter_errors(message)) == []
    message["type"] = "io.kai-isolator.pod.scheduled.v1"
    assert [e.message for e in validator("io.kai-isolator.pod.scheduled.v1").iter_errors(message)] == ["'scheduled' was expected"]


def test_unknown_fields_are_accepted_so_additions_never_break_a_validating_subscriber() -> None:
    message = verdict_message(added_later={"anything": 1})
    message["traceparent"] = "00-abc-def-01"  # a CloudEvents extension attribute
    assert list(validator("io.kai-isolator.health.verdict.v1").iter_errors(message)) == []


def asyncapi() -> dict[str, Any]:
    return yaml.safe_load((EVENTS / event_contract.ASYNCAPI_FILE).read_text())


def test_the_asyncapi_document_has_every_subject_with_its_parameters_and_every_type() -> None:
    doc = asyncapi()
    assert doc["asyncapi"].startswith("3.")
    builders = {name for name, f in inspect.getmembers(subjects, inspect.isfunction)
                if f.__module__ == subjects.__name__ and name not in ("encode_token", "decode_token", "parse")}
    addresses = {cid: ch["address"] for cid, ch in doc["channels"].items()}
    assert builders <= addresses.keys()
    assert addresses["health"] == "isolator.health.{ns}.{pod}"
    assert addresses["node_status"] == "isolator.node.{node}.status"
    assert addresses["dlq"] == "isolator.dlq.{service}"
    for cid, channel in doc["channels"].items():
        if channel["address"] is not None:
            placeholders = {p.strip("{}") for p in channel["address"].split(".") if p.startswith("{")}
            assert placeholders == set(channel.get("parameters", {})), cid
            assert all("`.` encoded as `_`" in p["description"] for p in channel.get("parameters", {}).values())
    assert set(doc["components"]["messages"]) == set(REGISTRY)
    on_channels = {ref["$ref"].rsplit("/", 1)[1] for ch in doc["channels"].values() for ref in ch["messages"].values()}
    assert on_channels == set(REGISTRY)
    assert doc["x-nats-jetstream"]["stream"] == subjects.STREAM_NAME
    assert doc["x-nats-jetstream"]["subjects"] == list(subjects.STREAM_SUBJECTS)
    assert "Nats-Msg-Id" in doc["x-nats-jetstream"]["deduplication"]
    assert subjects.NODE_STATUS_BUCKET in doc["x-nats-kv"]
    assert "`.` in a name travels as `_`" in doc["info"]["description"]


def test_the_node_agent_request_reply_operations_name_their_replies() -> None:
    operations = asyncapi()["operations"]
    inspect_op = operations["answer_node_inspect"]
    assert inspect_op["action"] == "receive"
    assert [m["$ref"].rsplit("/", 1)[1] for m in inspect_op["messages"]] == ["io.kai-isolator.node.inspect.request.v1"]
    assert [m["$ref"].rsplit("/", 1)[1] for m in inspect_op["reply"]["messages"]] == [
        "io.kai-isolator.node.inspect.reply.v1", "io.kai-isolator.error.reply.v1"]
    assert operations["publish_health"]["action"] == "send"
    events = asyncapi()["components"]["messages"]
    assert events["io.kai-isolator.health.verdict.v1"]["headers"] == {"$ref": "#/components/schemas/NatsHeaders"}
    assert "headers" not in events["io.kai-isolator.node.inspect.request.v1"]  # core NATS request, no de-duplication


@pytest.mark.timeout(600)
def test_the_asyncapi_parser_accepts_the_document() -> None:
    tools = contract_tools()
    result = subprocess.run([*tools.validate_asyncapi, str(EVENTS / "asyncapi.yaml")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "valid AsyncAPI 3.0.0" in result.stdout


@pytest.mark.timeout(600)
def test_the_asyncapi_parser_rejects_a_broken_document_and_says_where(tmp_path: Path) -> None:
    tools = contract_tools()
    doc = asyncapi()
    doc["operations"]["publish_health"]["channel"] = {"$ref": "#/channels/no-such-channel"}
    broken = tmp_path / "asyncapi.yaml"
    broken.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = subprocess.run([*tools.validate_asyncapi, str(broken)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "INVALID" in result.stdout and "no-such-channel" in result.stdout


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kai_isolator.services.cli", "events", *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "KAI_ISOLATOR_NATS_URL": "nats://127.0.0.1:9"})


def test_events_schema_prints_the_published_schema_without_touching_nats() -> None:
    result = cli("--schema", "io.kai-isolator.health.verdict.v1")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads((SCHEMAS / "io.kai-isolator.health.verdict.v1.json").read_text())


def test_events_schema_of_an_unknown_type_is_a_clear_error() -> None:
    result = cli("--schema", "io.kai-isolator.health.verdict.v9")
    assert result.returncode == 2
    assert "unknown event type 'io.kai-isolator.health.verdict.v9'" in result.stderr
    assert "io.kai-isolator.health.verdict.v1" in result.stderr
    assert result.stdout == ""
