"""AdmissionReview parsing and responses: every malformed body gets a one-line 400, a webhook bug a 500 review."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from kai_isolator.services.admission.webhook import Webhook


@pytest.mark.parametrize(("body", "reason"), [
    (b"", "not JSON"),
    (b"{not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', "missing request"),
    (b'{"request": null}', "missing request"),
    (b'{"request": "x"}', "request is not a JSON object"),
    (b'{"request": {"object": {}}}', "request.uid"),
    (b'{"request": {"uid": 7}}', "request.uid"),
    (b'{"apiVersion": "v1", "request": {"uid": "u"}}', "unsupported apiVersion"),
    (b'{"kind": "Pod", "request": {"uid": "u"}}', "kind must be AdmissionReview"),
])
def test_malformed_reviews_get_a_one_line_400(webhook: Webhook, body: bytes, reason: str) -> None:
    answer = webhook.handle(body)
    assert answer.status == 400 and answer.record is None
    text = answer.body.decode()
    assert reason in text and text.endswith("\n") and text.count("\n") == 1


@pytest.mark.parametrize(("obj", "reason"), [
    ("a string", "not a JSON object"),
    ({"metadata": {"annotations": {"gpu-fraction": 0.5}}}, "annotations must map strings to strings"),
    ({"metadata": {"annotations": {"gpu-fraction": "0.5"}}}, "spec is missing"),
    ({"metadata": {"annotations": {"gpu-fraction": "0.5"}}, "spec": {"containers": "main"}}, "spec.containers must be a list"),
    ({"metadata": {"annotations": {"gpu-fraction": "0.5"}}, "spec": {"containers": [{"image": "x"}]}}, "spec.containers[0].name"),
    ({"metadata": {"annotations": {"gpu-fraction": "0.5"}}, "spec": {"containers": [{"name": "m", "volumeMounts": [{"name": "v"}]}]}}, "mountPath"),
    ({"metadata": {"annotations": {"gpu-fraction": "0.5"}}, "spec": {"containers": [{"name": "m", "env": [{"value": "x"}]}]}}, "env[0].name"),
    ({"metadata": {"annotations": {"gpu-fraction": "0.5"}}, "spec": {"containers": [{"name": "m"}], "volumes": {}}}, "spec.volumes"),
])
def test_a_pod_that_cannot_be_read_is_denied_clearly(kit: SimpleNamespace, webhook: Webhook, obj: object, reason: str) -> None:
    response = kit.response_of(webhook.handle(kit.review_of(obj)))
    assert response["allowed"] is False and response["status"]["code"] == 400
    assert response["status"]["message"].startswith("cannot read pod: ") and reason in response["status"]["message"]


def test_missing_api_version_and_kind_are_filled_in(kit: SimpleNamespace, webhook: Webhook) -> None:
    body = orjson.dumps({"request": {"uid": "u-9", "kind": {"kind": "Pod"}, "object": kit.make_pod()}})
    review = orjson.loads(webhook.handle(body).body)
    assert review == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"uid": "u-9", "allowed": True}}


def test_v1beta1_is_echoed(kit: SimpleNamespace, webhook: Webhook) -> None:
    body = orjson.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
                         "request": {"uid": "u", "kind": {"kind": "Pod"}, "object": kit.make_pod()}})
    assert orjson.loads(webhook.handle(body).body)["apiVersion"] == "admission.k8s.io/v1beta1"


def test_an_unexpected_exception_becomes_a_500_review_echoing_the_uid(kit: SimpleNamespace, webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(webhook, "decide", broken)
    answer = webhook.handle(kit.review_of(kit.make_pod({"gpu-fraction": "0.5"}), uid="uid-42"))
    response = kit.response_of(answer)
    assert response["uid"] == "uid-42" and response["allowed"] is False and response["status"]["code"] == 500
    assert answer.record.decision == "denied"
