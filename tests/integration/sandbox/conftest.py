"""Fixtures for sandbox API tests: the sandbox itself, a kubernetes-asyncio client on its kubeconfig, a tiny TLS webhook."""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from kubernetes_asyncio import client, config

from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.sandbox.settings import SandboxSettings


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[SandboxApi]:
    settings = SandboxSettings(kubeconfig=tmp_path / "kubeconfig", bookmark_interval_s=0.1, node_step_s=0.02, retained_events=50)
    async with SandboxApi(settings) as api:
        yield api


@pytest.fixture
async def core(sandbox: SandboxApi) -> AsyncIterator[client.CoreV1Api]:
    api = await config.new_client_from_config(config_file=str(sandbox.settings.kubeconfig))
    async with api:
        yield client.CoreV1Api(api)


class RecordingWebhook:
    """An HTTPS AdmissionReview endpoint with a trustme CA; `respond` decides each answer."""

    def __init__(self) -> None:
        self.ca = trustme.CA()
        self.reviews: list[dict[str, Any]] = []
        self.respond: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] = self.add_label
        self.url = ""
        self.paths: list[str] = []

    @property
    def ca_pem(self) -> bytes:
        return self.ca.cert_pem.bytes()

    @staticmethod
    async def add_label(request: dict[str, Any]) -> dict[str, Any]:
        patch = [{"op": "add", "path": "/metadata/labels", "value": {"mutated-by": "test-webhook"}}]
        return {"allowed": True, "patchType": "JSONPatch", "patch": base64.b64encode(json.dumps(patch).encode()).decode(), "warnings": ["looked at it"]}

    async def handle(self, http: web.Request) -> web.Response:
        review = await http.json()
        self.reviews.append(review)
        self.paths.append(http.path_qs)
        answer = await self.respond(review["request"])
        return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"uid": review["request"]["uid"], **answer}})


@pytest.fixture
async def webhook() -> AsyncIterator[RecordingWebhook]:
    hook = RecordingWebhook()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    hook.ca.issue_cert("127.0.0.1").configure_cert(server_context)
    app = web.Application()
    app.router.add_post("/mutate", hook.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context)
    await site.start()
    host, port = runner.addresses[0][:2]
    hook.url = f"https://{host}:{port}/mutate"
    yield hook
    await runner.cleanup()


def pod_body(name: str, annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations or {}, "labels": labels or {}},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
