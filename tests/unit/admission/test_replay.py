"""Replayed answers: a body that differs from a decided one only in request.uid is answered as a full
decision would answer it, and nothing else is ever replayed (a uid found in the wrong place, a body
that differs elsewhere, a uid JSON would escape)."""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.replay import Replays
from kai_isolator.services.admission.webhook import Answer, Webhook
from support.pods import gpu_pod


def fresh(raw: bytes, mode: str = "warn", gated: bool = False) -> Answer:
    """The answer of a webhook that has seen nothing before."""
    return Webhook(InjectionConfig(), mode, readiness_gate=gated).handle(raw)  # type: ignore[arg-type]


def body(pod: dict[str, Any], uid: str) -> bytes:
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                         "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                     "operation": "CREATE", "namespace": "ns", "object": pod}})


def workload_pod(**spec: Any) -> dict[str, Any]:
    """One workload's pod (support.pods.gpu_pod): half a GPU, no scheduler named, a container with 50 env vars."""
    main = {"name": "main", "env": [{"name": f"V{i}", "value": "x"} for i in range(50)]}
    return gpu_pod("p", namespace="ns", gpu_memory=None, gpu_fraction="0.5", scheduler=None, containers=[main], **spec)


def replayed(webhook: Webhook, raw: bytes) -> bool:
    fitted = webhook.replays.match(raw)
    return fitted is not None and fitted[0].verified


def test_the_third_body_of_a_workload_is_replayed_exactly_as_decided() -> None:
    webhook = Webhook(InjectionConfig(), "warn")
    pod = workload_pod(securityContext={"seccompProfile": {"type": "RuntimeDefault"}})
    first, second, third = (body(pod, str(uuid.uuid4())) for _ in range(3))
    webhook.handle(first)
    assert not replayed(webhook, second)  # a template is learned, not trusted
    webhook.handle(second)
    assert replayed(webhook, third)
    answer = webhook.handle(third)
    assert answer == fresh(third)
    assert answer.record is not None and answer.record.request_uid in third.decode()


def test_a_body_that_differs_elsewhere_is_decided_in_full() -> None:
    webhook = Webhook(InjectionConfig(), "enforce")
    confined = workload_pod(securityContext={"seccompProfile": {"type": "RuntimeDefault"}})
    unconfined = workload_pod(securityContext={"seccompProfile": {"type": "RuntimeDefaulT"}})  # same length, not confining
    for _ in range(3):
        webhook.handle(body(confined, str(uuid.uuid4())))
    raw = body(unconfined, str(uuid.uuid4()))
    assert len(raw) == len(body(confined, str(uuid.uuid4()))) and not replayed(webhook, raw)
    answer = webhook.handle(raw)
    assert answer == fresh(raw, "enforce") and answer.record is not None and answer.record.decision == "denied"


def test_a_uid_found_inside_another_string_is_never_trusted() -> None:
    """The request's uid written with an escape; its plain spelling only inside an annotation. The
    cut lands in the annotation, and the next body (another annotation) must not replay."""
    pod = workload_pod(securityContext={"seccompProfile": {"type": "RuntimeDefault"}})
    webhook = Webhook(InjectionConfig(), "warn")

    def tricky(inner: str) -> bytes:
        pod["metadata"]["annotations"]["note"] = f'x"{inner}'
        return body(pod, "abc-1").replace(b'"uid":"abc-1"', b'"uid":"\\u0061bc-1"', 1)

    for inner in ("abc-1", "zzz-9", "yyy-8"):
        raw = tricky(inner)
        assert not replayed(webhook, raw)
        assert webhook.handle(raw) == fresh(raw)


def test_uids_json_would_escape_are_not_spliced() -> None:
    replays = Replays()
    webhook = Webhook(InjectionConfig(), "warn")
    webhook.replays = replays
    pod = workload_pod()
    for uid in ('a"b', "a\\b", "ä-1", "x y") * 3:
        webhook.handle(body(pod, uid))
    assert len(replays) == 0


def test_the_set_of_templates_is_bounded_in_number_and_body_size() -> None:
    webhook = Webhook(InjectionConfig(), "warn")
    webhook.replays = Replays(capacity=8)
    for i in range(40):
        pod = workload_pod()
        pod["metadata"]["name"] = "p" * (i + 1)  # lengths apart: one key each
        webhook.handle(body(pod, str(uuid.uuid4())))
    assert len(webhook.replays) == 8
    large = Webhook(InjectionConfig(), "warn")
    pod = workload_pod()
    pod["spec"]["containers"][0]["env"] = [{"name": f"V{i}", "value": "x" * 100} for i in range(1000)]  # ~120 KB
    for _ in range(3):
        large.handle(body(pod, str(uuid.uuid4())))
    assert len(large.replays) == 0
