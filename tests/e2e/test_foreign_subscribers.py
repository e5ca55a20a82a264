"""The TypeScript and Go example subscribers (docs/events/examples), run as a user would against the stack's real NATS:
each sees and validates every verdict the demo's scenarios produce, resumes its durable consumer after a restart,
and reports a message that breaks the contract instead of crashing on it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest

from kai_isolator.services.demo.scenario import demo_pod
from kai_isolator.shared.events import HealthVerdict, PodRef, encode
from support.contract import SCHEMAS, ContractTools, contract_tools


@pytest.fixture(scope="session")
def tools() -> ContractTools:
    return contract_tools()


@dataclass
class Subscriber:
    """One example subscriber process; its stdout goes to a file the test reads."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    exit_codes: list[int] = field(default_factory=list)
    readies: int = 0

    def start(self) -> None:
        self.readies = self.count("ready:")
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def count(self, prefix: str) -> int:
        return sum(line.startswith(prefix) for line in self.lines())

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def valid_ids(self) -> list[str]:
        return [line.split()[1].removeprefix("id=") for line in self.lines() if line.startswith("valid id=")]

    async def wait_for(self, what: str, done: Callable[[list[str]], bool], timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(self.lines()):
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.process.returncode}) waiting for {what}:\n" + "\n".join(self.lines()))
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not show {what} in {timeout_s:g}s:\n" + "\n".join(self.lines()))
            await asyncio.sleep(0.1)

    async def ready(self) -> None:
        await self.wait_for("its ready line", lambda _: self.count("ready:") > self.readies)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.exit_codes.append(self.process.wait(timeout=15))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self.exit_codes.append(-9)
        self.process = None


@pytest.fixture
def subscribers(tools: ContractTools, chain, tmp_path: Path) -> Iterator[dict[str, Subscriber]]:  # type: ignore[no-untyped-def]
    run = uuid.uuid4().hex[:8]
    started = {}
    for name, argv in (("node", tools.node_subscriber), ("go", tools.go_subscriber)):
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path)), "NATS_URL": chain.ctx.nats_url,
               "DURABLE": f"verdicts-{name}-{run}", "SCHEMA_DIR": str(SCHEMAS)}
        started[name] = Subscriber(name, argv, env, tmp_path / f"{name}.out")
    yield started
    for subscriber in started.values():
        subscriber.stop()


def verdicts(chain) -> list[HealthVerdict]:  # type: ignore[no-untyped-def]
    return [e for e in chain.bus.events if isinstance(e, HealthVerdict)]


def expected_line(verdict: HealthVerdict) -> str:
    reasons = ",".join(r.code for r in verdict.reasons) or "-"
    return (f"valid id={verdict.dedup_id()} type={verdict.event_type} pod={verdict.pod.namespace}/{verdict.pod.name} "
            f"container={verdict.container} verdict={verdict.verdict} reasons={reasons}")


async def tampering_degrades(chain) -> None:  # type: ignore[no-untyped-def]
    """A process that zeroes its container's accounting totals makes a verified pod degraded."""
    # KAI books 4096 MiB per pod and the 15360 MiB T4 holds three: the opted-out pod's story is told, it makes room.
    await chain.demo.core.delete_namespaced_pod("opted-out", "default", grace_period_seconds=0)
    pod = await chain.demo.create(demo_pod("tamperer", {}))
    await chain.demo.scheduled(pod)
    container = await chain.demo.start(pod)
    await chain.demo.verdict(pod, "verified")
    zero_totals = "import os; f = os.open('/run/kai-isolator/usage.cache', os.O_WRONLY); [os.pwrite(f, bytes(8), 72 + 128 * d) for d in range(16)]"
    await container.exec(["python3", "-c", zero_totals])
    verifier = chain.ctx.values["verifier"]
    [tracked] = [p for p in await verifier.tracked_pods() if p.pod.name == "tamperer"]
    await verifier.verify(tracked)
    await chain.bus.wait_for("the degraded verdict", lambda e: isinstance(e, HealthVerdict) and e.pod.name == "tamperer" and e.verdict == "degraded")


async def publish_foreign_messages(url: str) -> None:
    """One message that claims the verdict type but breaks its schema, and one of a type newer than the schemas."""
    forged = json.loads(encode(HealthVerdict(pod=PodRef(namespace="default", name="forged", uid="f1"), node_name="gpu-node-1",
                                             container="main", verdict="verified", observation="forged"), "not-the-verifier"))
    forged["data"]["verdict"] = "trust-me"
    future = {**forged, "id": "future-1", "type": "io.kai-isolator.health.breach.v1", "data": {"anything": True}}
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.publish("isolator.health.default.forged", json.dumps(forged).encode(), headers={"Nats-Msg-Id": forged["id"]})
        await js.publish("isolator.health.default.future", json.dumps(future).encode(), headers={"Nats-Msg-Id": "future-1"})
    finally:
        await nc.drain()


@pytest.mark.timeout(300)
async def test_node_and_go_subscribers_validate_and_print_every_verdict_of_the_demo(chain, subscribers) -> None:  # type: ignore[no-untyped-def]
    node, go = subscribers["node"], subscribers["go"]
    for subscriber in (node, go):
        subscriber.start()
        await subscriber.ready()

    await chain.demo.isolated_pod()  # 1. verified
    for subscriber in (node, go):
        await subscriber.wait_for("the first verdict", lambda lines: any("pod=default/gpu-sharing-demo" in line for line in lines))
    go.stop()  # the Go subscriber is away while the next scenarios run; its durable consumer keeps its place

    await chain.demo.opted_out_pod()  # 2. missing (not-injected)
    await publish_foreign_messages(chain.ctx.nats_url)
    go.start()
    await go.ready()
    await chain.demo.pod_admitted_while_webhook_down()  # 3. missing, with a Warning event
    await tampering_degrades(chain)  # 4. verified, then degraded (usage-cache-tampered)

    published = verdicts(chain)
    assert [v.verdict for v in published] == ["verified", "missing", "missing", "verified", "degraded"]
    wanted = [expected_line(v) for v in published]
    for subscriber in (node, go):
        await subscriber.wait_for("every verdict", lambda lines: set(wanted) <= set(lines))
    for subscriber in (node, go):
        lines = subscriber.lines()
        assert sorted(subscriber.valid_ids()) == sorted(v.dedup_id() for v in published), "each verdict exactly once, none missing"
        [invalid] = [line for line in lines if line.startswith("invalid ")]
        assert "subject=isolator.health.default.forged type=io.kai-isolator.health.verdict.v1" in invalid and "verdict" in invalid
        [skipped] = [line for line in lines if line.startswith("skipped ")]
        assert 'no published schema for type "io.kai-isolator.health.breach.v1"' in skipped

    for subscriber in (node, go):
        subscriber.stop()
        print(f"\n--- {subscriber.name} subscriber output ---\n" + "\n".join(subscriber.lines()))
    assert node.exit_codes == [0] and go.exit_codes == [0, 0]
    assert node.count("stopped") == 1 and go.count("stopped") == 2


async def test_a_subscriber_without_nats_or_schemas_says_why_and_exits(tools: ContractTools, tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "NATS_URL": "nats://127.0.0.1:9", "SCHEMA_DIR": str(SCHEMAS)}
    for argv in (tools.node_subscriber, tools.go_subscriber):
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == 1 and "cannot connect to NATS at nats://127.0.0.1:9" in result.stderr, result.stderr
        result = subprocess.run(argv, capture_output=True, text=True, env={**env, "SCHEMA_DIR": str(tmp_path)}, timeout=60)
        assert result.returncode == 1 and f"no schemas in {tmp_path}" in result.stderr, result.stderr
