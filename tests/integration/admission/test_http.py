"""The webhook over real HTTPS: a mutation, the bad-input table, probes and metrics; the server
keeps answering after every bad request."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import orjson
import pytest

from kai_isolator.services.admission.server import AdmissionServer
from kai_isolator.services.admission.settings import MAX_BODY_BYTES

JSON = {"Content-Type": "application/json"}


async def post(client: aiohttp.ClientSession, server: AdmissionServer, body: bytes, headers: dict[str, str] | None = None,
               path: str = "/mutate?timeout=10s") -> tuple[int, bytes]:
    async with client.post(server.url + path, data=body, headers=headers or JSON) as response:
        return response.status, await response.read()


async def test_gpu_pod_is_patched_over_https(start_webhook: Any, client: aiohttp.ClientSession, reviews: Any) -> None:
    gpu_pod, review_bytes = reviews
    server = await start_webhook()
    status, body = await post(client, server, review_bytes(gpu_pod()))
    review = orjson.loads(body)
    assert status == 200 and review["apiVersion"] == "admission.k8s.io/v1" and review["kind"] == "AdmissionReview"
    response = review["response"]
    assert response["uid"] == "uid-1" and response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = orjson.loads(base64.b64decode(response["patch"]))
    assert [op["path"] for op in ops] == ["/spec/volumes", "/spec/containers/0/volumeMounts", "/spec/containers/0/env"]


async def test_the_gated_path_adds_the_readiness_gate_and_the_plain_one_does_not(
    start_webhook: Any, client: aiohttp.ClientSession, reviews: Any,
) -> None:
    gpu_pod, review_bytes = reviews
    server = await start_webhook()
    paths = {}
    for path in ("/mutate?timeout=10s", "/mutate-gated?timeout=10s"):
        status, body = await post(client, server, review_bytes(gpu_pod()), path=path)
        assert status == 200
        paths[path.split("?")[0]] = [op["path"] for op in orjson.loads(base64.b64decode(orjson.loads(body)["response"]["patch"]))]
    assert paths["/mutate-gated"] == paths["/mutate"] + ["/spec/readinessGates"]


def oversized() -> bytes:
    return b'{"request": {"uid": "u", "pad": "' + b"x" * MAX_BODY_BYTES + b'"}}'


async def chunks(data: bytes):  # type: ignore[no-untyped-def]
    for start in range(0, len(data), 256 * 1024):
        yield data[start:start + 256 * 1024]


BAD_INPUTS = [
    ("wrong content type", b"{}", {"Content-Type": "text/plain"}, "content type must be application/json"),
    ("no content type", b"{}", {"Content-Type": ""}, "content type must be application/json"),
    ("over the cap", None, JSON, "over the"),
    ("not JSON", b"\x00\xffgarbage", JSON, "body is not JSON"),
    ("empty body", b"", JSON, "body is not JSON"),
    ("JSON but not an object", b'"review"', JSON, "body is not a JSON object"),
    ("no request", b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', JSON, "missing request"),
]


@pytest.mark.parametrize(("case", "body", "headers", "reason"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
async def test_bad_input_gets_a_one_line_400_and_the_server_keeps_serving(
    start_webhook: Any, client: aiohttp.ClientSession, reviews: Any, case: str, body: bytes | None, headers: dict[str, str], reason: str,
) -> None:
    gpu_pod, review_bytes = reviews
    server = await start_webhook()
    status, text = await post(client, server, body if body is not None else oversized(), headers)
    assert status == 400 and reason in text.decode() and text.decode().count("\n") == 1
    status, _ = await post(client, server, review_bytes(gpu_pod()))
    assert status == 200


async def test_chunked_body_over_the_cap_is_a_400(start_webhook: Any, client: aiohttp.ClientSession) -> None:
    server = await start_webhook()
    status, text = await post(client, server, chunks(oversized()))  # type: ignore[arg-type]
    assert status == 400 and b"over the" in text


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
async def test_non_post_is_405(start_webhook: Any, client: aiohttp.ClientSession, method: str) -> None:
    server = await start_webhook()
    async with client.request(method, server.url + "/mutate") as response:
        assert response.status == 405 and "POST" in await response.text()


async def test_other_kinds_are_allowed_without_patch(start_webhook: Any, client: aiohttp.ClientSession) -> None:
    server = await start_webhook()
    body = orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u-cm", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"}, "operation": "CREATE",
        "namespace": "a", "object": {"kind": "ConfigMap", "metadata": {"name": "c"}}}})
    status, text = await post(client, server, body)
    assert status == 200 and orjson.loads(text)["response"] == {"uid": "u-cm", "allowed": True}


async def test_unreadable_pod_is_refused_with_a_reason(start_webhook: Any, client: aiohttp.ClientSession) -> None:
    server = await start_webhook()
    body = orjson.dumps({"request": {"uid": "u-bad", "kind": {"kind": "Pod"}, "object": ["not", "a", "pod"]}})
    status, text = await post(client, server, body)
    response = orjson.loads(text)["response"]
    assert status == 200 and response["uid"] == "u-bad" and response["allowed"] is False
    assert response["status"] == {"code": 400, "message": "cannot read pod: request.object is not a JSON object"}


async def test_a_crash_in_the_decision_is_a_500_review_echoing_the_uid(
    start_webhook: Any, client: aiohttp.ClientSession, reviews: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_pod, review_bytes = reviews
    server = await start_webhook()

    def crash(_: object) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(server.webhook, "decide", crash)
    status, text = await post(client, server, review_bytes(gpu_pod(), uid="uid-crash"))
    response = orjson.loads(text)["response"]
    assert status == 200 and response["uid"] == "uid-crash" and response["allowed"] is False
    assert response["status"]["code"] == 500
    monkeypatch.undo()
    assert (await post(client, server, review_bytes(gpu_pod())))[0] == 200


async def test_probes_and_metrics(start_webhook: Any, client: aiohttp.ClientSession, reviews: Any) -> None:
    gpu_pod, review_bytes = reviews
    server = await start_webhook()
    await post(client, server, review_bytes(gpu_pod()))
    await post(client, server, review_bytes(gpu_pod(**{"kai-resource-isolator.io/inject": "false"})))
    await post(client, server, b"nope")
    for path in ("/healthz", "/readyz"):
        async with client.get(server.url + path) as response:
            assert response.status == 200 and (await response.text()).strip() == "ok"
    async with client.get(server.url + "/metrics") as response:
        metrics = await response.text()
    assert 'kai_isolator_admission_decisions_total{decision="injected"} 1.0' in metrics
    assert 'kai_isolator_admission_decisions_total{decision="skipped"} 1.0' in metrics
    assert "kai_isolator_admission_bad_requests_total 1.0" in metrics
    assert "kai_isolator_admission_seconds_count 3.0" in metrics
    # No bus given: every decision is counted as dropped, none is queued.
    assert 'kai_isolator_admission_events_dropped_total{reason="no_bus"} 2.0' in metrics


async def test_plain_http_is_refused(start_webhook: Any) -> None:
    server = await start_webhook()
    async with aiohttp.ClientSession() as plain:
        with pytest.raises(aiohttp.ClientError):
            async with plain.get(server.url.replace("https://", "http://") + "/healthz") as response:
                await response.read()
