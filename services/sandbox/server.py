"""The sandbox API's HTTP layer: kube-apiserver paths, discovery, list/watch and Status errors (test/demo fixture)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .status import ApiError
from .store import BY_PLURAL, RESOURCES, Obj, Resource, WatchStream
from .tables import table, wants_table

if TYPE_CHECKING:
    from .api import SandboxApi

log = logging.getLogger(__name__)

SERVER_VERSION = {
    "major": "1", "minor": "33", "gitVersion": "v1.33.0-kai-isolator-sandbox", "gitCommit": "sandbox", "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64",
}
_TRUE = {"1", "t", "T", "true", "TRUE", "True"}  # Go's strconv.ParseBool, which the real server uses
_GROUPS = sorted({r.group for r in RESOURCES if r.group})
MAX_BODY = 8 * 1024 * 1024


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "") in _TRUE


def _json(body: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    headers = {"Warning": ", ".join(f'299 - "{w}"' for w in warnings)} if warnings else None
    return web.Response(body=json.dumps(body, separators=(",", ":")).encode(), status=status, content_type="application/json", headers=headers)


def _error(error: ApiError) -> web.Response:
    return _json(error.status(), error.code)


def _resource_list(group_version: str) -> Obj:
    resources = []
    for r in RESOURCES:
        if r.api_version != group_version:
            continue
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        resources.append({"name": r.plural, "singularName": r.singular, "namespaced": r.namespaced, "kind": r.kind, "verbs": verbs, "shortNames": list(r.short_names)})
        if r.plural == "pods":
            resources.append({"name": "pods/status", "singularName": "", "namespaced": True, "kind": "Pod", "verbs": ["get", "patch", "update"]})
            resources.append({"name": "pods/binding", "singularName": "", "namespaced": True, "kind": "Binding", "verbs": ["create"]})
            resources.append({"name": "pods/eviction", "singularName": "", "namespaced": True, "group": "policy", "version": "v1", "kind": "Eviction", "verbs": ["create"]})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


def _group_list() -> Obj:
    groups = []
    for group in _GROUPS:
        version = {"groupVersion": f"{group}/v1", "version": "v1"}
        groups.append({"name": group, "versions": [version], "preferredVersion": version})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


class _Target:
    """What a resource path names: a collection or one object, maybe a subresource."""

    def __init__(self, resource: Resource, namespace: str | None, name: str | None, subresource: str) -> None:
        self.resource, self.namespace, self.name, self.subresource = resource, namespace, name, subresource


def _parse(group_version: str, parts: list[str]) -> _Target:
    def known(plural: str) -> Resource:
        resource = BY_PLURAL.get(plural)
        if resource is None or resource.api_version != group_version:
            raise ApiError(404, f"the server could not find the requested resource ({group_version} {plural})")
        return resource

    if len(parts) >= 3 and parts[0] == "namespaces":
        resource = known(parts[2])
        if not resource.namespaced or len(parts) > 5:
            raise ApiError(404, "the server could not find the requested resource")
        return _Target(resource, parts[1], parts[3] if len(parts) > 3 else None, parts[4] if len(parts) > 4 else "")
    if 1 <= len(parts) <= 3:
        resource = known(parts[0])
        if len(parts) == 1 or not resource.namespaced:
            return _Target(resource, None, parts[1] if len(parts) > 1 else None, parts[2] if len(parts) > 2 else "")
    raise ApiError(404, "the server could not find the requested resource")


class Handlers:
    def __init__(self, api: SandboxApi) -> None:
        self.api = api

    async def resources(self, request: web.Request) -> web.StreamResponse:
        grouped = request.path.startswith("/apis")
        rest = request.path[5:] if grouped else request.path[4:]
        parts = [p for p in rest.split("/") if p]
        try:
            if rest and not rest.startswith("/"):
                raise ApiError(404, "the server could not find the requested resource")
            if grouped:
                if not parts:
                    return _json(_group_list())
                if len(parts) == 1:
                    if parts[0] not in _GROUPS:
                        raise ApiError(404, "the server could not find the requested resource")
                    return _json(_group_list()["groups"][_GROUPS.index(parts[0])] | {"kind": "APIGroup", "apiVersion": "v1"})
                group_version, parts = f"{parts[0]}/{parts[1]}", parts[2:]
            else:
                if not parts:
                    return _json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": request.host}]})
                group_version, parts = parts[0], parts[1:]
            if not any(r.api_version == group_version for r in RESOURCES):
                raise ApiError(404, "the server could not find the requested resource")
            if not parts:
                return _json(_resource_list(group_version))
            return await self._dispatch(request, _parse(group_version, parts))
        except ApiError as error:
            return _error(error)
        except Exception as error:  # noqa: BLE001 - a bug answers a Status 500, never a dropped connection
            log.exception("sandbox request failed", extra={"path": request.path_qs})
            return _error(ApiError(500, f"Internal error occurred: {type(error).__name__}: {error}"))

    async def _dispatch(self, request: web.Request, target: _Target) -> web.StreamResponse:
        method = request.method
        dry_run = request.query.get("dryRun") == "All"
        r = target.resource
        if target.name is None:
            if method == "GET":
                if _flag(request, "watch"):
                    return await self._watch(request, target)
                return self._list(request, target)
            if method == "POST":
                warnings: list[str] = []
                created = await self.api.create(r.plural, await _body(request), target.namespace, dry_run=dry_run, warnings=warnings)
                return self._respond(request, r, created, 201, warnings)
            raise ApiError(405, f"{method} is not supported on a {r.kind} collection in the sandbox")
        if target.subresource == "binding" and r.plural == "pods" and method == "POST":
            self.api.bind(target.namespace or "", target.name, await _body(request))
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)
        if target.subresource == "eviction" and r.plural == "pods" and method == "POST":
            # No PodDisruptionBudgets in the sandbox: an eviction is a graceful delete.
            self.api.delete("pods", target.namespace, target.name, dry_run=dry_run)
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)
        if target.subresource not in ("", "status") or (target.subresource == "status" and r.plural != "pods"):
            raise ApiError(404, f"the server could not find the requested resource ({r.plural}/{target.subresource})")
        if method == "GET":
            return self._respond(request, r, self.api.get(r.plural, target.namespace, target.name))
        if method == "PATCH":
            patch = await _body(request)
            patched = self.api.patch(r.plural, target.namespace, target.name, request.content_type, patch, subresource=target.subresource, dry_run=dry_run)
            return self._respond(request, r, patched)
        if method == "PUT":
            replaced = self.api.replace(r.plural, target.namespace, target.name, await _body(request), subresource=target.subresource, dry_run=dry_run)
            return self._respond(request, r, replaced)
        if method == "DELETE" and not target.subresource:
            deleted = self.api.delete(r.plural, target.namespace, target.name, dry_run=dry_run)
            if r.plural == "pods":
                return self._respond(request, r, deleted)
            details = {"name": target.name, "group": r.group, "kind": r.plural, "uid": deleted["metadata"]["uid"]}
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details})
        raise ApiError(405, f"{method} is not supported here in the sandbox")

    def _respond(self, request: web.Request, resource: Resource, obj: Obj, status: int = 200, warnings: list[str] | None = None) -> web.Response:
        if wants_table(request.headers.get("Accept", "")):
            return _json(table(resource.plural, [obj], obj["metadata"].get("resourceVersion", ""), request.query.get("includeObject", "PartialObjectMetadata")), status, warnings)
        return _json(obj, status, warnings)

    def _list(self, request: web.Request, target: _Target) -> web.Response:
        r = target.resource
        items, rv = self.api.list(r.plural, target.namespace, request.query.get("labelSelector"), request.query.get("fieldSelector"))
        if wants_table(request.headers.get("Accept", "")):
            return _json(table(r.plural, items, str(rv), request.query.get("includeObject", "PartialObjectMetadata")))
        return _json({"kind": f"{r.kind}List", "apiVersion": r.api_version, "metadata": {"resourceVersion": str(rv)}, "items": items})

    async def _watch(self, request: web.Request, target: _Target) -> web.StreamResponse:
        r, settings = target.resource, self.api.settings
        store = self.api.store
        send_initial = _flag(request, "sendInitialEvents")
        version = request.query.get("resourceVersion")
        if send_initial:
            version = "0"
        try:
            stream = store.watch(r.plural, target.namespace, request.query.get("labelSelector"), request.query.get("fieldSelector"), version)
        except ApiError as error:
            if error.code != 410:
                raise
            # Like the real server: the watch itself succeeds and says 410 in an ERROR event.
            stream = None
            expired = error
        as_table = wants_table(request.headers.get("Accept", ""))
        include = request.query.get("includeObject", "PartialObjectMetadata")
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Cache-Control": "no-cache"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if stream is None:
            await response.write(_line("ERROR", expired.status()))
            await response.write_eof()
            return response
        timeout = settings.watch_timeout_s
        if request.query.get("timeoutSeconds", "").isdigit():
            timeout = min(timeout, float(request.query["timeoutSeconds"]))
        bookmarks = _flag(request, "allowWatchBookmarks")
        try:
            await self._pump(response, stream, r, timeout, bookmarks, send_initial, as_table, include)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            store.unwatch(stream)
        return response

    async def _pump(self, response: web.StreamResponse, stream: WatchStream, r: Resource, timeout: float, bookmarks: bool, send_initial: bool, as_table: bool, include: str) -> None:
        store = self.api.store
        deadline = time.monotonic() + timeout
        pending_initial = send_initial
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if pending_initial and stream.queue.empty():
                pending_initial = False
                marker = {"kind": r.kind, "apiVersion": r.api_version, "metadata": {"resourceVersion": str(store.rv), "annotations": {"k8s.io/initial-events-end": "true"}}}
                await response.write(_line("BOOKMARK", marker))
                continue
            wait = min(remaining, self.api.settings.bookmark_interval_s) if bookmarks else remaining
            try:
                item = await asyncio.wait_for(stream.queue.get(), wait)
            except asyncio.TimeoutError:
                if bookmarks and stream.queue.empty() and deadline - time.monotonic() > 0:
                    # Every change up to store.rv has been queued and the queue is empty: safe to advertise.
                    await response.write(_line("BOOKMARK", {"kind": r.kind, "apiVersion": r.api_version, "metadata": {"resourceVersion": str(store.rv)}}))
                continue
            batch = [item]
            while not stream.queue.empty() and len(batch) < 512:
                batch.append(stream.queue.get_nowait())
            chunk = []
            closing = False
            for entry in batch:
                if entry is None:
                    closing = True
                    break
                kind, obj = entry
                shown = table(r.plural, [obj], obj["metadata"]["resourceVersion"], include) if as_table else obj
                chunk.append(_line(kind, shown))
            if chunk:
                await response.write(b"".join(chunk))
            if closing:
                break
        await response.write_eof()


def _line(kind: str, obj: Obj) -> bytes:
    return json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"


async def _body(request: web.Request) -> Any:
    media = request.content_type
    if "yaml" in media or "protobuf" in media:
        raise ApiError(415, f"the sandbox API accepts JSON bodies only, not {media!r}")
    try:
        return json.loads(await request.read() or b"null")
    except ValueError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


def build_app(api: SandboxApi) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    handlers = Handlers(api)

    async def version(_: web.Request) -> web.Response:
        return _json(SERVER_VERSION)

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def no_openapi(_: web.Request) -> web.Response:
        return _error(ApiError(404, "the sandbox API serves no OpenAPI document; use kubectl --validate=false"))

    app.router.add_get("/version", version)
    for probe in ("/healthz", "/readyz", "/livez"):
        app.router.add_get(probe, ok)
    app.router.add_get("/openapi/{path:.*}", no_openapi)
    app.router.add_route("*", "/apis{path:.*}", handlers.resources)
    app.router.add_route("*", "/api{path:.*}", handlers.resources)
    return app
