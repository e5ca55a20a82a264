"""The /healthz, /readyz and /metrics endpoints every service serves."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from .settings import split_host_port

ReadyCheck = Callable[[], list[str]]
"""Returns what is not ready yet; empty means ready."""


def add_probe_routes(app: web.Application, registry: CollectorRegistry, not_ready: ReadyCheck) -> None:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        missing = not_ready()
        if missing:
            return web.Response(status=503, text="not ready: " + "; ".join(missing) + "\n")
        return web.Response(text="ok\n")

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", make_aiohttp_handler(registry))


class ProbeServer:
    """A plain-HTTP aiohttp site with only the probe routes."""

    def __init__(self, listen: str, registry: CollectorRegistry, not_ready: ReadyCheck) -> None:
        self._host, self._port = split_host_port(listen)
        self._app = web.Application()
        add_probe_routes(self._app, registry, not_ready)
        self._runner = web.AppRunner(self._app, access_log=None)
        self.url = ""

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        await self._runner.cleanup()
