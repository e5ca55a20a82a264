"""Fixtures for `kubectl isolator`: `cluster` (a Kubernetes API by kubeconfig) and a proxy that forbids one namespace.

`cluster` is the one fixture to change when these tests move to a real kube-apiserver (issue 14): every
test talks to the API through `cluster.kubeconfig`, never through the sandbox's in-process methods.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import ClientSession, web
from kubernetes_asyncio import config

from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.sandbox.settings import SandboxSettings
from plugin_cluster import Cluster


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """The API server these tests use, by kubeconfig (today the sandbox fixture; issue 14 swaps in kube-apiserver)."""
    async with SandboxApi(SandboxSettings(kubeconfig=tmp_path / "kubeconfig", gpu_nodes=())) as sandbox:
        assert sandbox.settings.kubeconfig is not None
        api = await config.new_client_from_config(config_file=str(sandbox.settings.kubeconfig))
        async with api:
            yield Cluster(sandbox.settings.kubeconfig, api)


@pytest.fixture
async def forbidding_proxy(cluster: Cluster, tmp_path: Path) -> AsyncIterator[Path]:
    """A kubeconfig through a proxy that answers requests for namespace `locked` (and cluster-wide lists) with the
    API server's own 403 Status, as RBAC would for a user bound to one namespace; everything else passes through."""
    upstream = json.loads(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    session = ClientSession()

    async def handle(request: web.Request) -> web.StreamResponse:
        path = request.path
        locked = path.startswith("/api/v1/namespaces/locked/") or path in ("/api/v1/pods", "/api/v1/events", "/api/v1/nodes")
        if locked:
            resource = path.rstrip("/").split("/")[-1]
            where = 'in the namespace "locked"' if "/namespaces/locked/" in path else "at the cluster scope"
            return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden", "code": 403,
                                      "message": f'{resource} is forbidden: User "tenant" cannot list resource "{resource}" in API group "" {where}'}, status=403)
        async with session.request(request.method, upstream + request.path_qs, headers={"Accept": "application/json"}, data=await request.read()) as response:
            return web.Response(body=await response.read(), status=response.status, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    document = json.loads(cluster.kubeconfig.read_text())
    document["clusters"][0]["cluster"]["server"] = f"http://{host}:{port}"
    path = tmp_path / "tenant-kubeconfig"
    path.write_text(json.dumps(document))
    yield path
    await session.close()
    await runner.cleanup()
