"""Every NATS subject name, built and parsed here and nowhere else.

Kubernetes names may contain '.', which NATS uses as the token separator. They never
contain '_', so a '.' in a name travels as '_' and comes back unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from .errors import DecodeError

ROOT = "isolator"
STREAM_NAME = "ISOLATOR"

SubjectKind = Literal["admission", "pod", "health", "usage", "grant", "node-status", "inspect", "install", "rollout", "dlq"]

# Event subjects captured by the JetStream stream. Request/reply subjects are not.
STREAM_SUBJECTS: tuple[str, ...] = (
    f"{ROOT}.admission.>",
    f"{ROOT}.pod.>",
    f"{ROOT}.health.>",
    f"{ROOT}.usage.>",
    f"{ROOT}.grant.>",
    f"{ROOT}.node.*.status",
    f"{ROOT}.rollout.>",
    f"{ROOT}.dlq.>",
)
ALL_EVENTS = f"{ROOT}.>"

# KV buckets more than one service reads (a service's private buckets live in its settings).
NODE_STATUS_BUCKET = "isolator_nodes"
"""Node agents write their NodeStatus under the node name; the installer waits on it."""

_TOKEN = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")


def encode_token(name: str) -> str:
    """Turn a Kubernetes name into one subject token."""
    if not _TOKEN.match(name):
        raise DecodeError(f"not a Kubernetes name usable in a subject: {name!r}")
    return name.replace(".", "_")


def decode_token(token: str) -> str:
    return token.replace("_", ".")


def admission(namespace: str) -> str:
    return f"{ROOT}.admission.{encode_token(namespace)}"


def pod(namespace: str, name: str) -> str:
    return f"{ROOT}.pod.{encode_token(namespace)}.{encode_token(name)}"


def health(namespace: str, name: str) -> str:
    return f"{ROOT}.health.{encode_token(namespace)}.{encode_token(name)}"


def usage(namespace: str, name: str) -> str:
    return f"{ROOT}.usage.{encode_token(namespace)}.{encode_token(name)}"


def grant(namespace: str, name: str) -> str:
    return f"{ROOT}.grant.{encode_token(namespace)}.{encode_token(name)}"


def node_status(node: str) -> str:
    return f"{ROOT}.node.{encode_token(node)}.status"


def node_inspect(node: str) -> str:
    return f"{ROOT}.node.{encode_token(node)}.inspect"


def node_install(node: str) -> str:
    return f"{ROOT}.node.{encode_token(node)}.install"


def rollout(rollout_id: str) -> str:
    return f"{ROOT}.rollout.{encode_token(rollout_id)}"


def dlq(service: str) -> str:
    return f"{ROOT}.dlq.{encode_token(service)}"


# Wildcards a consumer filters on.
ALL_ADMISSION = f"{ROOT}.admission.>"
ALL_PODS = f"{ROOT}.pod.>"
ALL_HEALTH = f"{ROOT}.health.>"
ALL_USAGE = f"{ROOT}.usage.>"
ALL_GRANTS = f"{ROOT}.grant.>"
ALL_NODE_STATUS = f"{ROOT}.node.*.status"
ALL_ROLLOUTS = f"{ROOT}.rollout.>"
ALL_DLQ = f"{ROOT}.dlq.>"


@dataclass(frozen=True)
class Subject:
    """A parsed subject: which kind, and the Kubernetes names it carries."""

    kind: SubjectKind
    namespace: str | None = None
    pod: str | None = None
    node: str | None = None
    service: str | None = None
    rollout: str | None = None


def parse(subject: str) -> Subject:
    """Inverse of the builders above; raises DecodeError for anything else."""
    tokens = subject.split(".")
    if len(tokens) < 3 or tokens[0] != ROOT:
        raise DecodeError(f"not an isolator subject: {subject!r}")
    kind, names = tokens[1], [decode_token(t) for t in tokens[2:]]
    if kind == "admission" and len(names) == 1:
        return Subject("admission", namespace=names[0])
    if kind in ("pod", "health", "usage", "grant") and len(names) == 2:
        return Subject(kind, namespace=names[0], pod=names[1])  # type: ignore[arg-type]
    if kind == "node" and len(names) == 2 and tokens[3] in ("status", "inspect", "install"):
        node_kind = "node-status" if tokens[3] == "status" else tokens[3]
        return Subject(node_kind, node=names[0])  # type: ignore[arg-type]
    if kind == "rollout" and len(names) == 1:
        return Subject("rollout", rollout=names[0])
    if kind == "dlq" and len(names) == 1:
        return Subject("dlq", service=names[0])
    raise DecodeError(f"not an isolator subject: {subject!r}")
