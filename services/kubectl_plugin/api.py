"""The plugin's only way out: GET requests to the Kubernetes API with the user's kubeconfig, as plain JSON,
each failure turned into one clear IsolatorError (never a traceback)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from kai_isolator.shared.errors import ConfigError, IsolatorError

Obj = dict[str, Any]
_TIMEOUT = (5, 30)


class ApiError(IsolatorError):
    """The API answered with an error Status (403, 404, ...), or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Kube:
    """A connected client; `namespace` is the context's default namespace (kubectl's rule)."""

    def __init__(self, api: client.ApiClient, namespace: str, server: str) -> None:
        self._api = api
        self.namespace = namespace
        self.server = server

    @classmethod
    async def connect(cls, kubeconfig: Path | None, context: str | None) -> Kube:
        configuration = client.Configuration()
        files = [Path(kubeconfig)] if kubeconfig else [Path(p).expanduser() for p in
                                                       (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep) if p]
        if not any(f.is_file() for f in files):
            raise ConfigError(f"no kubeconfig: {', '.join(map(str, files))} does not exist (use --kubeconfig or set KUBECONFIG)")
        try:
            loader = await config.load_kube_config(config_file=str(kubeconfig) if kubeconfig else None, context=context,
                                                   client_configuration=configuration, persist_config=False)
        except (ConfigException, FileNotFoundError, OSError, ValueError) as error:
            where = str(kubeconfig) if kubeconfig else "$KUBECONFIG or ~/.kube/config"
            raise ConfigError(f"cannot load a kubeconfig from {where}: {error}") from None
        namespace = "default"
        current = getattr(loader, "current_context", None)
        if current is not None and "context" in current and "namespace" in current["context"]:
            namespace = str(current["context"]["namespace"]) or "default"
        return cls(client.ApiClient(configuration), namespace, configuration.host)

    async def close(self) -> None:
        await self._api.close()

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def get(self, path: str, **query: str) -> Obj:
        """GET `path` (e.g. /api/v1/pods) and return the decoded JSON object."""
        params = [(k.replace("_", ""), v) for k, v in query.items() if v]
        try:
            response = await self._api.call_api(path, "GET", query_params=params, header_params={"Accept": "application/json"},
                                                 auth_settings=["BearerToken"], _preload_content=False, _request_timeout=_TIMEOUT)
            body = await response.read()
        except ApiException as error:
            if not error.status:  # the client's own wording for a connection it could not make
                raise ApiError(f"cannot reach the Kubernetes API at {self.server}: {error.reason}") from None
            raise ApiError(_status_message(error.body, error.reason, error.status), error.status) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
            raise ApiError(f"cannot reach the Kubernetes API at {self.server}: {error or type(error).__name__}") from None
        if not 200 <= response.status <= 299:
            raise ApiError(_status_message(body, response.reason, response.status), response.status)
        try:
            return json.loads(body)  # type: ignore[no-any-return]
        except ValueError:
            raise ApiError(f"the API at {self.server} answered {path} with something that is not JSON") from None

    async def list(self, plural: str, namespace: str | None = None, *, field_selector: str = "", group: str = "") -> list[Obj]:
        prefix = f"/apis/{group}" if group else "/api/v1"
        path = f"{prefix}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{prefix}/{plural}"
        return list((await self.get(path, fieldSelector=field_selector)).get("items") or [])

    async def pod(self, namespace: str, name: str) -> Obj:
        return await self.get(f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}")


def _status_message(body: bytes | str | None, reason: str | None, code: int) -> str:
    """kubectl's wording: `Error from server (Forbidden): <the Status message>`."""
    try:
        status = json.loads(body or b"{}")
    except ValueError:
        status = {}
    message = status.get("message") if isinstance(status, dict) else None
    kind = (status.get("reason") if isinstance(status, dict) else None) or reason or "Error"
    return f"Error from server ({kind}): {message or reason or code}"
