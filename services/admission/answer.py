"""What one AdmissionReview gets back: the HTTP answer, and the record of what was decided."""

from __future__ import annotations

from typing import NamedTuple

from kai_isolator.shared.events import AdmissionOutcome

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


class Answer(NamedTuple):
    status: int
    body: bytes
    content_type: str
    record: DecisionRecord | None = None


def bad_request(message: str) -> Answer:
    return Answer(400, f"{message}\n".encode(), TEXT)
