"""The watcher's own Kubernetes client: kubeconfig and in-cluster configuration, TLS, tokens, the watch stream."""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import trustme
import yaml
from aiohttp import web

from kai_isolator.services.watcher import kube
from kai_isolator.services.watcher.kube import Endpoint, KubeApiError, KubeClient, load_endpoint
from kai_isolator.shared.errors import ConfigError

TIMEOUT = aiohttp.ClientTimeout(total=5)


def kubeconfig(cluster: dict[str, Any], user: dict[str, Any], name: str = "ctx") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Config", "current-context": name,
            "clusters": [{"name": f"{name}-cluster", "cluster": cluster}], "users": [{"name": f"{name}-user", "user": user}],
            "contexts": [{"name": name, "context": {"cluster": f"{name}-cluster", "user": f"{name}-user"}}]}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_a_yaml_kubeconfig_with_inline_certificates_gives_a_working_tls_context(tmp_path: Path) -> None:
    ca = trustme.CA()
    client = ca.issue_cert("watcher")
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(kubeconfig(
        {"server": "https://127.0.0.1:6443/", "certificate-authority-data": b64(ca.cert_pem.bytes())},
        {"client-certificate-data": b64(client.cert_chain_pems[0].bytes()), "client-key-data": b64(client.private_key_pem.bytes())})))
    endpoint = load_endpoint(path, environ={})
    assert endpoint.server == "https://127.0.0.1:6443"
    assert endpoint.ca_data == ca.cert_pem.bytes() and endpoint.client_key_data == client.private_key_pem.bytes()
    context = kube.ssl_context(endpoint)
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_file_names_in_a_kubeconfig_are_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "certs").mkdir()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(kubeconfig({"server": "https://h:1", "certificate-authority": "certs/ca.crt"}, {"tokenFile": "certs/token"})))
    endpoint = load_endpoint(path, environ={})
    assert endpoint.ca_file == tmp_path / "certs" / "ca.crt"
    assert endpoint.token_file == tmp_path / "certs" / "token"


def test_in_cluster_uses_the_service_account_and_brackets_an_ipv6_host(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    endpoint = load_endpoint(None, environ={"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, sa_dir=tmp_path)
    assert endpoint.server == "https://[fd00::1]:443"
    assert endpoint.ca_file == tmp_path / "ca.crt" and endpoint.token_file == tmp_path / "token"
    assert KubeClient(endpoint)._headers()["Authorization"] == "Bearer sa-token"


def test_without_in_cluster_the_first_kubeconfig_naming_a_context_wins(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_text(json.dumps(kubeconfig({"server": "https://first"}, {"token": "one"}, name="first")))
    second.write_text(json.dumps(kubeconfig({"server": "https://second"}, {"token": "two"}, name="second")))
    endpoint = load_endpoint(None, environ={"KUBECONFIG": f"{tmp_path / 'missing'}:{first}:{second}"}, sa_dir=tmp_path / "no-sa")
    assert (endpoint.server, endpoint.token) == ("https://first", "one")


@pytest.mark.parametrize("user", [{"exec": {"command": "aws"}}, {"auth-provider": {"name": "gcp"}}])
def test_plugin_credentials_are_refused_clearly(tmp_path: Path, user: dict[str, Any]) -> None:
    path = tmp_path / "config"
    path.write_text(json.dumps(kubeconfig({"server": "https://h"}, user)))
    with pytest.raises(ConfigError, match="not supported"):
        load_endpoint(path, environ={})


def test_a_missing_or_broken_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no kubeconfig"):
        load_endpoint(tmp_path / "absent", environ={})
    broken = tmp_path / "broken"
    broken.write_text("clusters: [")
    with pytest.raises(ConfigError, match="cannot read"):
        load_endpoint(broken, environ={})
    nameless = tmp_path / "nameless"
    nameless.write_text(json.dumps({**kubeconfig({"server": "https://h"}, {}), "current-context": "other"}))
    with pytest.raises(ConfigError, match="no context named 'other'"):
        load_endpoint(nameless, environ={})


def test_a_rotated_token_file_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("old")
    client = KubeClient(Endpoint(server="http://h", token_file=token))
    assert client._headers()["Authorization"] == "Bearer old"
    token.write_text("new")
    assert client._headers()["Authorization"] == "Bearer old"  # not on every request
    monkeypatch.setattr(kube, "TOKEN_REREAD_S", -1.0)
    assert client._headers()["Authorization"] == "Bearer new"


class Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


async def test_watch_lines_are_split_across_and_within_chunks() -> None:
    stream = Chunks([b'{"a":1}\n{"b"', b':2}\n\n{"c":3}\n{"d":', b"4}"])
    assert [orjson.loads(line) async for line in kube._lines(stream)] == [{"a": 1}, {"b": 2}, {"c": 3}, {"d": 4}]  # type: ignore[arg-type]


@pytest.fixture
async def api() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A tiny API server: a list, a watch that ends with 410 Gone, and a bearer token check."""
    seen: list[dict[str, Any]] = []

    async def pods(request: web.Request) -> web.StreamResponse:
        seen.append({"query": dict(request.query), "auth": request.headers.get("Authorization")})
        if request.headers.get("Authorization") != "Bearer secret":
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        if request.query.get("watch") != "true":
            return web.json_response({"metadata": {"resourceVersion": "7"}, "items": []})
        response = web.StreamResponse()
        await response.prepare(request)
        for event in ({"type": "ADDED", "object": {"metadata": {"name": "p", "resourceVersion": "8"}}},
                      {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
                      {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}):
            await response.write(orjson.dumps(event) + b"\n")
        return response

    app = web.Application()
    app.router.add_get("/api/v1/pods", pods)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_list_watch_and_a_410_error_event(api: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = api
    client = KubeClient(Endpoint(server=url, token="secret"))
    try:
        listing = await client.get("/api/v1/pods", {"fieldSelector": "spec.nodeName=n"}, TIMEOUT)
        assert listing["metadata"]["resourceVersion"] == "7"
        events = []
        with pytest.raises(KubeApiError) as gone:
            async for event in client.watch("/api/v1/pods", {"resourceVersion": "7"}, TIMEOUT):
                events.append(event["type"])
        assert gone.value.status == 410 and "too old" in gone.value.reason
        assert events == ["ADDED", "BOOKMARK"]
        assert seen[0]["query"] == {"fieldSelector": "spec.nodeName=n"}
        assert seen[1]["query"] == {"resourceVersion": "7", "watch": "true"}
    finally:
        await client.close()


async def test_an_answer_that_is_not_a_success_carries_its_status_and_message(api: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = api
    client = KubeClient(Endpoint(server=url, token="wrong"))
    try:
        with pytest.raises(KubeApiError) as refused:
            await client.get("/api/v1/pods", {}, TIMEOUT)
        assert (refused.value.status, refused.value.reason) == (401, "Unauthorized")
    finally:
        await client.close()
