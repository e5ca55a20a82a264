"""A lean Kubernetes API client for the watcher: list, watch and get over aiohttp with orjson, nothing generated.

kubernetes_asyncio's generated client costs ~74 MiB RSS to import; the watcher needs three GET calls.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field

from kai_isolator.shared.errors import ConfigError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_S = 60.0
"""Projected service-account tokens rotate on disk (hourly by default); reread them this often."""
MAX_LINE = 16 * 1024 * 1024
"""A watch line longer than this is treated as a broken stream rather than buffered further."""


class KubeApiError(Exception):
    """An API answer that is not a success: HTTP status (or a watch ERROR event's code) and the server's message."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


class Endpoint(BaseModel):
    """Where the API server is and how to authenticate to it: what a kubeconfig or a service account says."""

    model_config = ConfigDict(frozen=True)
    server: str = Field(min_length=1)
    ca_file: Path | None = None
    ca_data: bytes | None = None
    insecure_skip_tls_verify: bool = False
    tls_server_name: str | None = None
    client_cert_file: Path | None = None
    client_key_file: Path | None = None
    client_cert_data: bytes | None = None
    client_key_data: bytes | None = None
    token: str | None = None
    token_file: Path | None = None
    username: str | None = None
    password: str | None = None


# --- configuration ----------------------------------------------------------------------


def load_endpoint(kubeconfig: Path | None, environ: Mapping[str, str] = os.environ, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Endpoint:
    """The explicit kubeconfig, else the in-cluster service account, else $KUBECONFIG or ~/.kube/config."""
    if kubeconfig is not None:
        return from_kubeconfig([Path(kubeconfig)])
    if environ.get("KUBERNETES_SERVICE_HOST") and environ.get("KUBERNETES_SERVICE_PORT") and (sa_dir / "token").is_file():
        return in_cluster(environ, sa_dir)
    paths = [Path(p).expanduser() for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    return from_kubeconfig(paths or [Path("~/.kube/config").expanduser()])


def in_cluster(environ: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Endpoint:
    host, port = environ["KUBERNETES_SERVICE_HOST"], environ["KUBERNETES_SERVICE_PORT"]
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    ca = sa_dir / "ca.crt"
    if not ca.is_file():
        raise ConfigError(f"in-cluster config: {ca} is missing")
    return Endpoint(server=f"https://{host}:{port}", ca_file=ca, token_file=sa_dir / "token")


def _named(items: Any, name: str | None, what: str, source: str) -> dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return dict(item.get(what) or {})
    raise ConfigError(f"{source}: no {what} named {name!r}")


def _merged(paths: list[Path]) -> tuple[dict[str, Any], Path]:
    """kubectl's merge of several kubeconfigs, as far as the watcher reads them: the first file naming a thing wins."""
    merged: dict[str, Any] = {"clusters": [], "users": [], "contexts": []}
    base: Path | None = None
    for path in paths:
        try:
            loaded = _parse(path.read_bytes(), path)
        except FileNotFoundError:
            continue
        except OSError as error:
            raise ConfigError(f"cannot read kubeconfig {path}: {error}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"kubeconfig {path} is not a mapping")
        base = base or path.parent
        if not merged.get("current-context"):
            merged["current-context"] = loaded.get("current-context")
        for key in ("clusters", "users", "contexts"):
            known = {item.get("name") for item in merged[key]}
            for item in loaded.get(key) or []:
                if isinstance(item, dict) and item.get("name") not in known:
                    # Relative file names in a kubeconfig are relative to that file.
                    merged[key].append({**item, "_dir": str(path.parent)})
    if base is None:
        raise ConfigError(f"no kubeconfig found at {', '.join(map(str, paths))}")
    return merged, base


def _parse(text: bytes, path: Path) -> Any:
    """JSON (a subset of YAML, what generated kubeconfigs often are) without loading a YAML parser; YAML otherwise."""
    try:
        return orjson.loads(text) or {}
    except orjson.JSONDecodeError:
        pass
    import yaml  # only here: a few MiB the JSON case never pays

    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"cannot read kubeconfig {path}: {error}") from None


def from_kubeconfig(paths: list[Path]) -> Endpoint:
    merged, _ = _merged(paths)
    source = ", ".join(map(str, paths))
    context = _named(merged["contexts"], merged.get("current-context"), "context", source)
    cluster_entry = next((c for c in merged["clusters"] if c.get("name") == context.get("cluster")), None)
    cluster = _named(merged["clusters"], context.get("cluster"), "cluster", source)
    user = _named(merged["users"], context.get("user"), "user", source) if context.get("user") else {}
    user_entry = next((u for u in merged["users"] if u.get("name") == context.get("user")), {})
    if user.get("exec") or user.get("auth-provider"):
        raise ConfigError(f"{source}: exec and auth-provider credentials are not supported by the watcher; use a token or client certificate")

    def path(entry: dict[str, Any] | None, value: Any) -> Path | None:
        if not value:
            return None
        return (Path(str((entry or {}).get("_dir", "."))) / str(value)).expanduser()

    def data(value: Any) -> bytes | None:
        return base64.b64decode(value) if value else None

    if not cluster.get("server"):
        raise ConfigError(f"{source}: cluster {context.get('cluster')!r} names no server")
    return Endpoint(
        server=str(cluster["server"]).rstrip("/"),
        ca_file=path(cluster_entry, cluster.get("certificate-authority")), ca_data=data(cluster.get("certificate-authority-data")),
        insecure_skip_tls_verify=bool(cluster.get("insecure-skip-tls-verify")), tls_server_name=cluster.get("tls-server-name"),
        client_cert_file=path(user_entry, user.get("client-certificate")), client_key_file=path(user_entry, user.get("client-key")),
        client_cert_data=data(user.get("client-certificate-data")), client_key_data=data(user.get("client-key-data")),
        token=user.get("token") or None, token_file=path(user_entry, user.get("tokenFile")),
        username=user.get("username"), password=user.get("password"),
    )


def ssl_context(endpoint: Endpoint) -> ssl.SSLContext | None:
    """The TLS context the endpoint asks for (None for plain http)."""
    if not endpoint.server.startswith("https://"):
        return None
    try:
        context = ssl.create_default_context(cafile=str(endpoint.ca_file) if endpoint.ca_file else None,
                                             cadata=endpoint.ca_data.decode() if endpoint.ca_data else None)
        if endpoint.insecure_skip_tls_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if endpoint.client_cert_file:
            context.load_cert_chain(str(endpoint.client_cert_file), str(endpoint.client_key_file) if endpoint.client_key_file else None)
        elif endpoint.client_cert_data:
            _load_cert_data(context, endpoint.client_cert_data, endpoint.client_key_data)
    except (OSError, ssl.SSLError, ValueError) as error:
        raise ConfigError(f"cannot set up TLS to {endpoint.server}: {error}") from None
    return context


def _load_cert_data(context: ssl.SSLContext, cert: bytes, key: bytes | None) -> None:
    # ssl loads a client certificate from files only: a private directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="kai-watcher-tls-") as folder:
        cert_path, key_path = Path(folder) / "client.crt", Path(folder) / "client.key"
        cert_path.write_bytes(cert)
        if key:
            key_path.write_bytes(key)
        context.load_cert_chain(str(cert_path), str(key_path) if key else None)


# --- the client -------------------------------------------------------------------------


class KubeClient:
    """GETs against one API server as one identity; JSON decoded with orjson."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._ssl = ssl_context(endpoint)
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = endpoint.token
        self._token_read_at = 0.0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else False, limit=8)
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=lambda o: orjson.dumps(o).decode())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._current_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        elif self.endpoint.username is not None:
            pair = f"{self.endpoint.username}:{self.endpoint.password or ''}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        return headers

    def _current_token(self, force: bool = False) -> str | None:
        if self.endpoint.token_file is None:
            return self._token
        if force or self._token is None or time.monotonic() - self._token_read_at > TOKEN_REREAD_S:
            try:
                self._token = self.endpoint.token_file.read_text().strip()
                self._token_read_at = time.monotonic()
            except OSError as error:
                if self._token is None:
                    raise ConfigError(f"cannot read the token file {self.endpoint.token_file}: {error}") from None
        return self._token

    def _kwargs(self, server_name: str | None) -> dict[str, Any]:
        return {"server_hostname": server_name} if server_name else {}

    async def get(self, path: str, params: Mapping[str, str], timeout: aiohttp.ClientTimeout) -> Any:
        """One GET, its JSON body decoded; KubeApiError for a non-2xx answer."""
        for attempt in (0, 1):
            async with self._client().get(self.endpoint.server + path, params=params, headers=self._headers(), timeout=timeout,
                                          **self._kwargs(self.endpoint.tls_server_name)) as response:
                body = await response.read()
                if response.status == 401 and attempt == 0 and self.endpoint.token_file is not None:
                    self._current_token(force=True)  # rotated under us: reread and try once more
                    continue
                if response.status >= 400:
                    raise KubeApiError(response.status, status_message(body))
                return orjson.loads(body)
        raise AssertionError("unreachable")

    async def watch(self, path: str, params: Mapping[str, str], timeout: aiohttp.ClientTimeout) -> AsyncIterator[dict[str, Any]]:
        """The watch stream's events (`type`, `object`) as they come; an ERROR event is raised as KubeApiError."""
        query = {**params, "watch": "true"}
        async with self._client().get(self.endpoint.server + path, params=query, headers=self._headers(), timeout=timeout,
                                      **self._kwargs(self.endpoint.tls_server_name)) as response:
            if response.status == 401 and self.endpoint.token_file is not None:
                self._current_token(force=True)
            if response.status >= 400:
                raise KubeApiError(response.status, status_message(await response.read()))
            async for line in _lines(response.content):
                try:
                    event = orjson.loads(line)
                except orjson.JSONDecodeError:
                    raise KubeApiError(0, f"unreadable watch line: {line[:200]!r}") from None
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise KubeApiError(int(status.get("code") or 500), str(status.get("message") or status))
                yield event


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Newline-separated lines of a chunked body; a chunk usually holds many, a line may span chunks."""
    pending = b""
    async for chunk in stream.iter_any():
        data = pending + chunk if pending else chunk
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if end > start:
                yield data[start:end]
            start = end + 1
        pending = data[start:]
        if len(pending) > MAX_LINE:
            raise KubeApiError(0, f"a watch line longer than {MAX_LINE} bytes")
    if pending.strip():
        yield pending


def status_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body).get("message", ""))
    except (orjson.JSONDecodeError, AttributeError):
        return body[:200].decode(errors="replace")
