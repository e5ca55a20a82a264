"""What one AdmissionReview gets back: the response review, the HTTP answer, and the record of what was decided."""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson

from kai_isolator.shared.events import AdmissionOutcome

from .review import DEFAULT_API_VERSION, KIND, AdmissionRequest

JSON = "application/json"
TEXT = "text/plain"


class DecisionRecord(NamedTuple):
    """What the webhook decided, kept small (a tuple): the event is built from it off the request path."""

    request_uid: str
    namespace: str
    pod_name: str
    decision: AdmissionOutcome
    reason: str
    container: str | None = None
    findings: tuple[str, ...] = ()
    patch_operations: int = 0
    # A dry run (`kubectl apply --dry-run=server`) creates nothing: its decision is counted but never published,
    # as `sideEffects: None` promises the API server.
    dry_run: bool = False
    # An AdmissionDecision event tells of a pod's creation; an update's answer is counted and logged, not published.
    published: bool = True


class Answer(NamedTuple):
    status: int
    body: bytes
    content_type: str
    record: DecisionRecord | None = None


def bad_request(message: str) -> Answer:
    return Answer(400, f"{message}\n".encode(), TEXT)


def _review(api_version: str, response: dict[str, Any]) -> bytes:
    return orjson.dumps({"apiVersion": api_version, "kind": KIND, "response": response})


def allowed(request: AdmissionRequest, patch: Sequence[dict[str, Any]] = (), warnings: Sequence[str] = (),
            patch_json: bytes | None = None) -> bytes:
    """Allow, with a JSONPatch when there is one (no patch fields otherwise); `patch_json`: the
    patch already serialised (a non-empty JSON array)."""
    response: dict[str, Any] = {"uid": request.uid, "allowed": True}
    if patch and patch_json is None:
        patch_json = orjson.dumps(patch)
    if patch_json is not None:
        response["patchType"] = "JSONPatch"
        response["patch"] = binascii.b2a_base64(patch_json, newline=False).decode("ascii")
    if warnings:
        response["warnings"] = list(warnings)
    return _review(request.api_version, response)


def denied(request: AdmissionRequest, code: int, message: str, warnings: Sequence[str] = ()) -> bytes:
    """Refuse the object, saying why (the HTTP status stays 200, as the API server expects)."""
    response: dict[str, Any] = {"uid": request.uid, "allowed": False, "status": {"code": code, "message": message}}
    if warnings:
        response["warnings"] = list(warnings)
    return _review(request.api_version, response)


def errored(uid: str, message: str, api_version: str = DEFAULT_API_VERSION) -> bytes:
    """A failure of the webhook itself: refused with code 500, still echoing the request UID."""
    return _review(api_version, {"uid": uid, "allowed": False, "status": {"code": 500, "message": message}})
