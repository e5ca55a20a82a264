"""Reading an AdmissionReview: the parts of its request the webhook uses, or one line saying what is wrong."""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from kai_isolator.shared.errors import IsolatorError

API_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
DEFAULT_API_VERSION = API_VERSIONS[0]
KIND = "AdmissionReview"


class BadReview(IsolatorError):
    """The body is not an AdmissionReview we can answer; the caller gets HTTP 400 and this text."""


class AdmissionRequest(NamedTuple):
    """The parts of `request` the webhook uses (a tuple: one is made per request)."""

    uid: str
    api_version: str
    kind: str
    group: str
    operation: str
    namespace: str
    object: Any
    dry_run: bool
    old_object: Any = None  # the pod before an UPDATE


def parse(raw: bytes) -> AdmissionRequest:
    """Read an AdmissionReview body; BadReview says in one line what is wrong."""
    try:
        review = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise BadReview(f"body is not JSON: {error}") from None
    if not isinstance(review, dict):
        raise BadReview("body is not a JSON object")
    api_version = review.get("apiVersion") or DEFAULT_API_VERSION
    if api_version not in API_VERSIONS:
        raise BadReview(f"unsupported apiVersion {api_version!r}; expected {DEFAULT_API_VERSION}")
    if review.get("kind", KIND) != KIND:
        raise BadReview(f"kind must be {KIND}, got {review.get('kind')!r}")
    request = review.get("request")
    if request is None:
        raise BadReview("missing request")
    if not isinstance(request, dict):
        raise BadReview("request is not a JSON object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("request.uid must be a non-empty string")
    kind = request.get("kind")
    kind_name, group = "", ""
    if isinstance(kind, dict):
        kind_name, group = str(kind.get("kind") or ""), str(kind.get("group") or "")
    obj = request.get("object")
    if not kind_name and isinstance(obj, dict):
        kind_name = str(obj.get("kind") or "")
    namespace = request.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        metadata = obj.get("metadata") if isinstance(obj, dict) else None
        namespace = metadata.get("namespace") if isinstance(metadata, dict) else None
    operation = request.get("operation") or "CREATE"
    return AdmissionRequest(uid, api_version, kind_name, group, operation if type(operation) is str else str(operation),
                            namespace if isinstance(namespace, str) else "", obj, request.get("dryRun") is True,
                            request.get("oldObject"))
