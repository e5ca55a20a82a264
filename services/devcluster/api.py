"""An asyncio REST client of the local kube-apiserver (one identity per client), and list-then-watch that rides out restarts.

What the simulated KAI-Scheduler and kubelet use; the services themselves use their own clients against any cluster.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .plane import ApiCallError

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
WatchHandler = Callable[[str, dict[str, Any]], Awaitable[None]]


class AsyncApi:
    """JSON REST calls as one identity (a client certificate); a non-2xx answer raises ApiCallError."""

    def __init__(self, url: str, ca_file: Path, cert_file: Path, key_file: Path) -> None:
        self.url = url
        self._ssl = ssl.create_default_context(cafile=str(ca_file))
        self._ssl.load_cert_chain(str(cert_file), str(key_file))
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=32))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                      timeout_s: float = 10) -> Any:
        data = None if body is None else orjson.dumps(body)
        async with self._client().request(method, self.url + path, data=data, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                          headers={"Content-Type": content_type, "Accept": "application/json"}) as answer:
            raw = await answer.read()
            if answer.status >= 300:
                try:
                    status = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    status = {"message": raw.decode(errors="replace")}
                raise ApiCallError(method, path, answer.status, status)
        return orjson.loads(raw) if raw else None

    async def informer(self, path: str, handle: WatchHandler, *, retry_s: float = 0.2) -> None:
        """List `path`, hand every object over as ADDED, then watch; relist after 410 Gone or a lost connection. Runs until cancelled."""
        while True:
            try:
                listed = await self.request("GET", path)
                for item in listed.get("items") or []:
                    await handle("ADDED", item)
                await self._watch(path, str(listed["metadata"]["resourceVersion"]), handle)
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, ApiCallError, asyncio.TimeoutError, OSError) as error:
                log.debug("watch of %s restarts: %s", path, error)
                await asyncio.sleep(retry_s)

    async def _watch(self, path: str, resource_version: str, handle: WatchHandler) -> None:
        separator = "&" if "?" in path else "?"
        while True:
            url = f"{self.url}{path}{separator}watch=1&allowWatchBookmarks=true&resourceVersion={resource_version}&timeoutSeconds=300"
            async with self._client().get(url, timeout=aiohttp.ClientTimeout(total=None, sock_read=330)) as answer:
                if answer.status >= 300:
                    raise ApiCallError("GET", path, answer.status, {"message": (await answer.read()).decode(errors="replace")})
                async for line in answer.content:
                    if not line.strip():
                        continue
                    event = orjson.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":  # 410 Gone inside the stream: the history is compacted, relist
                        raise ApiCallError("WATCH", path, int(obj.get("code") or 410), obj)
                    resource_version = str((obj.get("metadata") or {}).get("resourceVersion") or resource_version)
                    if kind != "BOOKMARK":
                        await handle(str(kind), obj)
