"""The event contract subscribers build on: a JSON Schema per CloudEvents type and the AsyncAPI 3 document,
both generated from the models in `events` and the subjects in `subjects` (`make contract` rewrites docs/events).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import typing
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import events, subjects
from .errors import DecodeError
from .events import CONTENT_TYPE, REGISTRY, Envelope, ErrorReply, NodeStatus, Payload

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
ASYNCAPI_VERSION = "3.0.0"
ASYNCAPI_FILE = "asyncapi.yaml"
SCHEMA_DIR = "schemas"
REGENERATE = "make contract"

# Subject-builder parameters, as the AsyncAPI channel parameters name them.
PARAMETERS: dict[str, tuple[str, str]] = {
    "namespace": ("ns", "Kubernetes namespace of the pod"),
    "name": ("pod", "pod name"),
    "node": ("node", "node name"),
    "service": ("service", "the service that gave up on the message (admission, watcher, verifier, nodeagent, installer)"),
    "rollout_id": ("rollout", "rollout id"),
}
ENCODING_NOTE = "Kubernetes names never contain `_`, so a `.` in a name travels as `_` (`ip-10-0-0-1.ec2.internal` → `ip-10-0-0-1_ec2_internal`)."

ENVELOPE_NOTES = {
    "specversion": "CloudEvents version",
    "id": "equals the `Nats-Msg-Id` header and names the fact (e.g. `pod:<uid>:<resourceVersion>:<state>`): "
          "a republication of the same fact carries the same id, JetStream drops it within the duplicate window, "
          "and a subscriber may de-duplicate on it",
    "source": "the publishing service",
    "type": "the event type; its last token is the payload version",
    "subject": "what the event is about: `<namespace>/<pod>`, a node name or a rollout id",
    "time": "when the event was published",
    "datacontenttype": "media type of `data`",
    "data": "the payload",
}

# KV buckets a subscriber may read (a service's private buckets are not part of the contract).
SHARED_BUCKETS: dict[str, tuple[str, type[BaseModel]]] = {
    subjects.NODE_STATUS_BUCKET: ("the node name", NodeStatus),
}

_SENTINEL = "kaisentinel"


# --- JSON Schemas ----------------------------------------------------------------------


def event_types() -> list[str]:
    return sorted(REGISTRY)


def model_for(event_type: str) -> type[Payload]:
    model = REGISTRY.get(event_type)
    if model is None:
        raise DecodeError(f"unknown event type {event_type!r}; known types: {', '.join(event_types())}")
    return model


def model_schemas(ref_template: str, models: Sequence[type[BaseModel]] | None = None) -> dict[str, Any]:
    """The JSON Schema of every payload model (or of `models`) and every model they use, keyed by model name."""
    chosen = events.PAYLOAD_CLASSES if models is None else models
    _, top = models_json_schema([(cls, "serialization") for cls in chosen], ref_template=ref_template)
    return dict(sorted(top.get("$defs", {}).items()))


def envelope_schema(event_type: str, ref_template: str, model: type[Payload] | None = None) -> dict[str, Any]:
    """The whole message: the CloudEvents envelope whose `type` is `event_type` and whose `data` is its payload."""
    model = model or model_for(event_type)
    generated = Envelope.model_json_schema(mode="serialization")
    properties: dict[str, Any] = {}
    for name in Envelope.model_fields:
        prop = {k: v for k, v in generated["properties"][name].items() if k not in ("title", "default")}
        properties[name] = {**prop, "description": ENVELOPE_NOTES.get(name, "")}
    properties["type"] = {"const": event_type, "description": ENVELOPE_NOTES["type"]}
    properties["datacontenttype"] = {"const": "application/json", "description": ENVELOPE_NOTES["datacontenttype"]}
    properties["subject"] = {"type": "string", "description": ENVELOPE_NOTES["subject"]}  # absent rather than null
    properties["data"] = {**_data_schema(event_type, model, ref_template), "description": ENVELOPE_NOTES["data"]}
    return {
        "title": event_type,
        "description": f"CloudEvents 1.0, structured JSON mode ({CONTENT_TYPE}); data: {model.__name__}. {_doc(model)}".strip(),
        "type": "object",
        "required": [name for name, field in Envelope.model_fields.items() if not _nullable(field.annotation)],
        "properties": properties,
    }


def event_schema(event_type: str, model: type[Payload] | None = None) -> dict[str, Any]:
    """One standalone JSON Schema (2020-12) for one event type (`docs/events/schemas/<type>.json`); `model`
    defaults to the registered payload class of the type."""
    template = "#/$defs/{model}"
    model = model or model_for(event_type)
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:kai-isolator:event:{event_type}",
        **envelope_schema(event_type, template, model),
        "$defs": model_schemas(template, [model]),  # only what this type uses, so the file changes only with it
    }


def _data_schema(event_type: str, model: type[Payload], ref_template: str) -> dict[str, Any]:
    ref = {"$ref": ref_template.format(model=model.__name__)}
    field = _discriminator(model)
    if field is None:
        return ref
    # One model, several types: the type's next-to-last token is the value of this field.
    return {"allOf": [ref, {"type": "object", "properties": {field: {"const": event_type.split(".")[-2]}}}]}


def _discriminator(model: type[Payload]) -> str | None:
    if len(model.TYPES) < 2:
        return None
    tokens = {t.split(".")[-2] for t in model.TYPES}
    for name, field in model.model_fields.items():
        if typing.get_origin(field.annotation) is typing.Literal and set(typing.get_args(field.annotation)) == tokens:
            return name
    return None


def _nullable(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _doc(model: type) -> str:
    return inspect.cleandoc(model.__doc__) if model.__doc__ else ""


# --- channels, from the subject builders ------------------------------------------------


class Channel(typing.NamedTuple):
    id: str
    address: str
    parameters: dict[str, str]  # AsyncAPI name -> description
    pattern: re.Pattern[str]
    in_stream: bool


def channels() -> list[Channel]:
    """Every subject `subjects` can build, as an AsyncAPI channel with its parameters."""
    found = []
    for name, builder in inspect.getmembers(subjects, inspect.isfunction):
        if builder.__module__ != subjects.__name__ or name.startswith("_"):
            continue
        params = list(inspect.signature(builder).parameters)
        try:
            sample = builder(*[f"{_SENTINEL}{i}" for i in range(len(params))])
        except (TypeError, DecodeError):
            continue
        if not isinstance(sample, str) or not sample.startswith(f"{subjects.ROOT}."):
            continue  # not a subject builder (token helpers, parse)
        address, parameters = sample, {}
        for i, param in enumerate(params):
            label, description = PARAMETERS.get(param, (param, param.replace("_", " ")))
            address = address.replace(f"{_SENTINEL}{i}", f"{{{label}}}")
            parameters[label] = description
        pattern = re.compile("^" + re.sub(r"\\\{[a-z_]+\\\}", r"[^.]+", re.escape(address)) + "$")
        found.append(Channel(name, address, parameters, pattern, any(_nats_match(p, sample) for p in subjects.STREAM_SUBJECTS)))
    return found


def _nats_match(pattern: str, subject: str) -> bool:
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def channel_of(model: type[Payload], all_channels: Sequence[Channel]) -> Channel | None:
    """The channel a payload class is published on (None: a reply, sent to the requester's inbox)."""
    try:
        subject = sample_payload(model).subject()
    except NotImplementedError:
        return None
    matches = [c for c in all_channels if c.pattern.match(subject)]
    if len(matches) != 1:
        raise DecodeError(f"{model.__name__} publishes on {subject!r}, which matches {len(matches)} subject builders in subjects.py")
    return matches[0]


def sample_payload(model: type[BaseModel]) -> Any:
    """An instance with placeholder values in its required fields (to ask it its subject, or to encode it)."""
    values = {name: _sample_value(field.annotation) for name, field in model.model_fields.items() if field.is_required()}
    return model.model_validate(values)


def _sample_value(annotation: Any) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return args[0]
    if args and type(None) in args:
        return None
    if origin in (list, tuple, set, frozenset):
        return []
    if origin is dict:
        return {}
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return sample_payload(annotation)
    simple: dict[Any, Any] = {str: _SENTINEL, int: 1, float: 1.0, bool: False, datetime: datetime(2025, 1, 1, tzinfo=timezone.utc)}
    if annotation in simple:
        return simple[annotation]
    raise DecodeError(f"cannot make a sample value of {annotation!r} to place its model on a subject")


# --- the AsyncAPI document ------------------------------------------------------------


def asyncapi_document() -> dict[str, Any]:
    template = "#/components/schemas/{model}"
    all_channels = channels()
    placed: dict[str, list[str]] = {c.id: [] for c in all_channels}
    replies: list[str] = []
    for event_type in event_types():
        channel = channel_of(model_for(event_type), all_channels)
        (placed[channel.id] if channel else replies).append(event_type)

    doc_channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for channel in all_channels:
        types = placed[channel.id]
        doc_channels[channel.id] = {
            "address": channel.address,
            "title": channel.id.replace("_", " "),
            "description": _channel_description(channel),
            "parameters": {name: {"description": f"{text}, with `.` encoded as `_`"} for name, text in channel.parameters.items()},
            "messages": {t: {"$ref": f"#/components/messages/{t}"} for t in types},
        }
        requests = [t for t in types if ".request." in t and not channel.in_stream]
        published = [t for t in types if t not in requests]
        if published:
            operations[f"publish_{channel.id}"] = _publish_operation(channel, published)
        if requests:
            reply_types = [r for t in requests for r in _replies_to(t) if r in replies]
            doc_channels[f"{channel.id}_reply"] = {
                "address": None,
                "title": f"reply to {channel.address}",
                "description": "the requester's inbox (the NATS reply subject of the request)",
                "messages": {t: {"$ref": f"#/components/messages/{t}"} for t in reply_types},
            }
            operations[f"answer_{channel.id}"] = _answer_operation(channel, requests, reply_types)

    schemas = model_schemas(template)
    streamed = {t for c in all_channels if c.in_stream for t in placed[c.id]}
    messages = {t: _message(t, t in streamed) for t in event_types()}
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "id": "urn:kai-isolator:events",
        "info": {
            "title": "kai-resource-isolator events",
            "version": _version(),
            "description": _info_description(),
            "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
        },
        "defaultContentType": CONTENT_TYPE,
        "servers": {
            "cluster": {
                "host": "nats.kai-resource-isolator.svc:4222",
                "protocol": "nats",
                "description": "the in-cluster NATS the services use (`KAI_ISOLATOR_NATS_URL`); `kai-isolator dev` runs a private one",
            },
        },
        "channels": doc_channels,
        "operations": operations,
        "components": {
            "schemas": {**schemas, **{t: envelope_schema(t, template) for t in event_types()}, "NatsHeaders": _headers_schema()},
            "messages": messages,
        },
        "x-nats-jetstream": {
            "stream": subjects.STREAM_NAME,
            "subjects": list(subjects.STREAM_SUBJECTS),
            "deduplication": "every event is published with header `Nats-Msg-Id` equal to its CloudEvents `id`; "
                             "the stream drops a second publication of the same id within its duplicate window "
                             "(KAI_ISOLATOR_DUPLICATE_WINDOW_S, default 120 s)",
            "retention": "events are kept KAI_ISOLATOR_STREAM_MAX_AGE_S (default 7 days); a durable consumer resumes where it acked",
        },
        "x-nats-kv": {
            bucket: {"key": key, "value": {"$ref": template.format(model=model.__name__)}, "description": f"the latest {model.__name__} (bare payload JSON, not a CloudEvent) under {key}"}
            for bucket, (key, model) in SHARED_BUCKETS.items()
        },
    }


def _publish_operation(channel: Channel, types: list[str]) -> dict[str, Any]:
    how = f"published to the {subjects.STREAM_NAME} stream with `Nats-Msg-Id` = CloudEvents `id`" if channel.in_stream else "published on core NATS"
    return {
        "action": "send",
        "title": f"publish on {channel.address}",
        "summary": how,
        "channel": {"$ref": f"#/channels/{channel.id}"},
        "messages": [{"$ref": f"#/channels/{channel.id}/messages/{t}"} for t in types],
    }


def _answer_operation(channel: Channel, requests: list[str], reply_types: list[str]) -> dict[str, Any]:
    responder = "the node agent on `{node}`" if "{node}" in channel.address else "the service that serves this subject"
    return {
        "action": "receive",
        "title": f"answer requests on {channel.address}",
        "summary": f"{responder} answers (one responder per service instance group); an unreadable or failed request gets an error reply",
        "channel": {"$ref": f"#/channels/{channel.id}"},
        "messages": [{"$ref": f"#/channels/{channel.id}/messages/{t}"} for t in requests],
        "reply": {
            "channel": {"$ref": f"#/channels/{channel.id}_reply"},
            "messages": [{"$ref": f"#/channels/{channel.id}_reply/messages/{t}"} for t in reply_types],
        },
    }


def _message(event_type: str, in_stream: bool) -> dict[str, Any]:
    model = model_for(event_type)
    message: dict[str, Any] = {
        "name": event_type,
        "title": model.__name__,
        "summary": (_doc(model).splitlines() or [model.__name__])[0],
        "contentType": CONTENT_TYPE,
    }
    if in_stream:
        message["headers"] = {"$ref": "#/components/schemas/NatsHeaders"}
    message["payload"] = {"$ref": f"#/components/schemas/{event_type}"}
    return message


def _replies_to(request_type: str) -> list[str]:
    return [request_type.replace(".request.", ".reply."), *ErrorReply.TYPES]


def _headers_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "Nats-Msg-Id": {"type": "string", "description": "equals the CloudEvents `id`: JetStream's de-duplication key"},
            "Content-Type": {"const": CONTENT_TYPE},
        },
        "required": ["Nats-Msg-Id"],
    }


def _channel_description(channel: Channel) -> str:
    if channel.in_stream:
        return f"Captured by the JetStream stream `{subjects.STREAM_NAME}`; subscribe with a wildcard on the parameters (e.g. `{re.sub(r'{[a-z_]+}', '*', channel.address)}`)."
    return "Request/reply on core NATS (not captured by the stream)."


def _info_description() -> str:
    return (
        "Every isolation event the control plane publishes on NATS, as CloudEvents 1.0 in structured JSON mode "
        f"(`Content-Type: {CONTENT_TYPE}`).\n\n"
        f"- Subjects: events are captured by the JetStream stream `{subjects.STREAM_NAME}` "
        f"({', '.join(f'`{s}`' for s in subjects.STREAM_SUBJECTS)}); request/reply subjects are not.\n"
        f"- Names in subjects: {ENCODING_NOTE}\n"
        "- De-duplication: the `Nats-Msg-Id` header equals the CloudEvents `id`, which names the fact, so a retried or "
        "replayed publication is dropped by the stream's duplicate window and a subscriber can de-duplicate on `id`.\n"
        "- Versions: the last token of `type` is the payload version. Within a version fields and event types are only "
        "added (new optional fields, new types, new enumeration values); anything else gets a new version. "
        "Subscribers ignore fields they do not know and accept enumeration values they do not know.\n"
        f"- KV buckets a subscriber may read: {', '.join(f'`{b}`' for b in SHARED_BUCKETS)} (see `x-nats-kv`).\n\n"
        f"Generated from `shared/events.py` and `shared/subjects.py` by `{REGENERATE}`; do not edit by hand."
    )


def _version() -> str:
    try:
        return metadata.version("kai-resource-isolator")
    except metadata.PackageNotFoundError:
        return "0.0.0"


# --- files -----------------------------------------------------------------------------


def render() -> dict[str, str]:
    """Every contract file, relative path -> content."""
    header = f"# Generated by `{REGENERATE}` from shared/events.py and shared/subjects.py; do not edit.\n"
    files = {ASYNCAPI_FILE: header + yaml.safe_dump(asyncapi_document(), sort_keys=False, width=120, allow_unicode=True)}
    for event_type in event_types():
        files[f"{SCHEMA_DIR}/{event_type}.json"] = json.dumps(event_schema(event_type), indent=2, ensure_ascii=False) + "\n"
    return files


def stale_files(directory: Path, files: dict[str, str] | None = None) -> list[str]:
    """Contract files under `directory` that differ from the code, are missing, or no longer belong."""
    files = render() if files is None else files
    stale = [path for path, text in files.items() if not (directory / path).is_file() or (directory / path).read_text() != text]
    extra = [f"{SCHEMA_DIR}/{p.name}" for p in sorted((directory / SCHEMA_DIR).glob("*.json")) if f"{SCHEMA_DIR}/{p.name}" not in files]
    return stale + extra


def write(directory: Path) -> list[str]:
    """Bring `directory` up to date with the code; returns what changed."""
    files = render()
    changed = stale_files(directory, files)
    for path in changed:
        target = directory / path
        if path in files:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(files[path])
        else:
            target.unlink()
    return changed


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m kai_isolator.shared.event_contract", description=__doc__)
    parser.add_argument("directory", type=Path, help="where the contract lives (docs/events)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.directory)
        for path in stale:
            out(f"out of date: {args.directory / path}")
        return 1 if stale else 0
    for path in write(args.directory):
        out(f"{'wrote' if (args.directory / path).exists() else 'removed'} {args.directory / path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
