"""The scoped NATS permissions deploy/README.md gives for an existing cluster are enough for what every service
does on the bus (provisioning, events, consumers, KV compare-and-set, leases, request/reply), on a real server."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from kai_isolator.services.installer.rollout import ROLLOUT_BUCKET
from kai_isolator.services.verifier.settings import VerifierSettings
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.embedded_nats import server_binary
from kai_isolator.shared.errors import BusError
from kai_isolator.shared.events import InspectReply, InspectRequest, PodIsolation, PodRef
from kai_isolator.shared.lease import LEASE_BUCKET, Lease
from kai_isolator.shared.ports import free_port
from kai_isolator.shared.settings import BusSettings
from support.waiting import eventually

BUCKETS = [WatcherSettings().state_bucket, WatcherSettings().resume_bucket, VerifierSettings().health_bucket,
           subjects.NODE_STATUS_BUCKET, LEASE_BUCKET, ROLLOUT_BUCKET]
# As deploy/README.md lists them ("An existing NATS cluster with accounts and credentials").
PUBLISH = ["isolator.>", "_INBOX.>", "$JS.API.>", "$JS.ACK.>", *(f"$KV.{b}.>" for b in BUCKETS)]
LEADER_ADVISORIES = "$JS.EVENT.ADVISORY.*.LEADER_ELECTED.>"
SUBSCRIBE = ["isolator.>", "_INBOX.>", LEADER_ADVISORIES]


class ScopedServer:
    def __init__(self, workdir: Path, publish: list[str], subscribe: list[str]) -> None:
        self.port = free_port()
        self.log = workdir / "nats.log"
        user = {"user": "kai", "password": "pw", "permissions": {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}}
        # NATS configuration is a superset of JSON: the account block written as JSON is a valid config.
        config = {"port": self.port, "jetstream": {"store_dir": str(workdir / "js")},
                  "accounts": {"KAI": {"jetstream": "enabled", "users": [user]}}}
        (workdir / "nats.conf").write_text(json.dumps(config))
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen([str(server_binary()), "-c", str(workdir / "nats.conf")],
                                            stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def violations(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if "Violation" in line]


@pytest.fixture
async def scoped(tmp_path: Path) -> AsyncIterator[Callable[..., ScopedServer]]:
    servers: list[ScopedServer] = []

    def start(publish: list[str], subscribe: list[str] = SUBSCRIBE) -> ScopedServer:
        workdir = tmp_path / f"server-{len(servers)}"
        workdir.mkdir()
        server = ScopedServer(workdir, publish, subscribe)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.process.kill()
        server.process.wait()


async def started(server: ScopedServer, on_pod: Callable[[PodIsolation], object]) -> Runtime:
    settings = BusSettings(nats_url=server.url, nats_user="kai", nats_password="pw", jetstream_timeout_s=3, publish_retry_s=3)

    async def handle(pod: PodIsolation) -> None:
        on_pod(pod)

    async def inspect(request: InspectRequest) -> InspectReply:
        return InspectReply(node_name=request.node_name, pod=request.pod, container=request.container, found=False, message="test")

    runtime = Runtime("scoped", settings, kv_buckets=BUCKETS)
    runtime.on_event("pods", subjects.ALL_PODS, handle)
    runtime.on_request(subjects.node_inspect("gpu-1"), inspect)
    for _ in range(50):  # the server was just spawned
        try:
            await runtime.start(server.url)
            return runtime
        except BusError:
            await asyncio.sleep(0.1)
    raise AssertionError("the scoped server never answered")


async def test_the_documented_permissions_cover_every_bus_operation(scoped: Callable[..., ScopedServer]) -> None:
    server = scoped(PUBLISH)
    seen: list[PodIsolation] = []
    runtime = await started(server, seen.append)
    try:
        pod = PodIsolation(pod=PodRef(namespace="team-a", name="p", uid="uid-p"), resource_version="1", state="running")
        await runtime.publish(pod)
        await eventually(lambda: len(seen) == 1)
        for bucket in BUCKETS:
            kv = runtime.kv(bucket)
            revision = await kv.create("probe", b"1")
            await kv.update("probe", b"2", last=revision)
            assert (await kv.get("probe")).value == b"2"
            assert await runtime.kv_keys(bucket) == ["probe"]
        reply = await runtime.request(InspectRequest(node_name="gpu-1", pod=pod.pod, container="main"))
        assert isinstance(reply, InspectReply) and reply.message == "test"
        lease = Lease(runtime.kv(LEASE_BUCKET), "watcher.all", "scoped@test", ttl_s=5)
        assert await lease.try_acquire()
        await lease.renew()
        await lease.release()
    finally:
        await runtime.stop()
    assert server.violations() == []


async def test_a_missing_permission_shows_as_a_violation(scoped: Callable[..., ScopedServer]) -> None:
    # The control: without `_INBOX.>` a node agent cannot answer, and the server says so.
    server = scoped([p for p in PUBLISH if p != "_INBOX.>"])
    runtime = await started(server, lambda pod: None)
    try:
        with pytest.raises(BusError):
            await runtime.request(InspectRequest(node_name="gpu-1", pod=PodRef(namespace="a", name="b", uid="c"), container="main"), timeout_s=1)
    finally:
        await runtime.stop()
    assert any("_INBOX" in line for line in server.violations())


async def test_without_the_leader_advisories_every_operation_still_works(scoped: Callable[..., ScopedServer]) -> None:
    # The advisories only wake a call waiting on an election (it polls without them): an account scoped as documented
    # before they were asked for keeps working, and the server names the one subscription it refused.
    server = scoped(PUBLISH, [s for s in SUBSCRIBE if s != LEADER_ADVISORIES])
    seen: list[PodIsolation] = []
    runtime = await started(server, seen.append)
    try:
        await runtime.publish(PodIsolation(pod=PodRef(namespace="team-a", name="p", uid="uid-p"), resource_version="1", state="running"))
        await eventually(lambda: len(seen) == 1)
        kv = runtime.kv(LEASE_BUCKET)
        revision = await kv.create("probe", b"1")
        assert (await kv.get("probe")).revision == revision
    finally:
        await runtime.stop()
    assert server.violations() and all("LEADER_ELECTED" in line for line in server.violations())
