"""The red team's escapes past the library (the attack table's rows that reach the driver), each as one program, and the
agent's enforcer at its shipped defaults: run on a node of either driver kind, judged by the node's ledger.

`tests/security/test_driver_capped.py` runs them on an R615 node and `bench/driver_cap.py` on both kinds, for the
table's driver-capped column: how far past the grants the driver went, and for how long (MiB·s)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu
from kai_isolator.services.nodeagent import enforce
from kai_isolator.services.nodeagent.agent import make_enforcer
from kai_isolator.services.nodeagent.nvml import Nvml
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.shared.contract import DEFAULT_GRANT_DIR
from kai_isolator.shared.events import Breach, PodRef
from security.container import BUILD, CUPROBE, GIB, MIB, NODE, Background, Container, SimNode, gpu_pod
from support.real_node import LedgerWatch

RAWELF = BUILD / "tests" / "rawelf"
DEEPBIND = BUILD / "tests" / "deepbind"
DEEPBIND_DSO = BUILD / "tests" / "libdeepbind.so"
SHIM = BUILD / "tests" / "libshim.so"
HOLD_MS = 600000
ATTACK = 4 * GIB  # what each hostile tenant asks for under a 1 GiB grant
SETUP_FAILED = "setup failed"  # rawelf's answer when the driver makes it no context
RAW = [str(RAWELF), str(ATTACK), str(HOLD_MS)]  # the raw ELF lookup's allocation past the library, held
WATCH_S = 3.0  # after the last allocation: three of the enforcer's polls at its shipped interval


class Shipped:
    """The agent's enforcer at its shipped defaults, in its own poll loop; an eviction stops the pod's
    containers, as the kubelet then does."""

    def __init__(self, node: SimNode, reader: Nvml) -> None:
        self.node = node
        self.settings = NodeAgentSettings(node_name=NODE)  # nothing set: what users run
        self.acted: list[tuple[float, enforce.Target, Breach]] = []
        self.evicted: list[tuple[float, PodRef]] = []
        self.measuring: list[object] = []  # complete polls seen measuring a container (polls_measuring)
        pods = enforce.KnownPods(node.root / DEFAULT_GRANT_DIR.lstrip("/"), lambda: {c.pod_ref.uid: c.pod for c in node.containers})
        self.enforcer = make_enforcer(self.settings, reader.snapshot, pods, self.report, self.evict)

    async def report(self, target: enforce.Target, breach: Breach) -> None:
        self.acted.append((time.monotonic(), target, breach))

    async def evict(self, pod: PodRef) -> bool:
        self.evicted.append((time.monotonic(), pod))
        for container in self.node.containers:
            if container.pod_ref.uid == pod.uid:
                await container.process.stop()
        return True

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Shipped]:
        loop = asyncio.create_task(self.enforcer.run(self.settings.enforce_interval_s))
        try:
            yield self
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)

    def first_action(self, container: Container) -> tuple[float, enforce.Target, Breach] | None:
        found = [(at, t, b) for at, t, b in self.acted if t.pod.uid == container.pod_ref.uid and t.container_id == container.container_id]
        return found[0] if found else None

    def polls_measuring(self, container: Container) -> int:
        """How many distinct complete polls measured `container` holding memory, counted from the first call on (ask
        often: it sees the enforcer's last poll only)."""
        last = self.enforcer.last
        if last is not None and last.ok and all(poll is not last for poll in self.measuring) and any(
                m.target.pod.uid == container.pod_ref.uid and m.used_bytes > 0 for m in last.measures):
            self.measuring.append(last)
        return len(self.measuring)

    def acted_at(self, container: Container) -> float:
        first = self.first_action(container)
        assert first is not None
        return first[0]

    def verdict(self, container: Container) -> str:
        """The agent's `breached` verdict on the container, else what the verifier says with the driver's view."""
        acted = [(t, b) for _, t, b in self.acted if t.pod.uid == container.pod_ref.uid and t.container_id == container.container_id]
        if acted:
            return "breached: " + ", ".join(sorted({r.code for t, b in acted for r in enforce.verdict(NODE, t, b).reasons}))
        judged = container.judge(inspected(container, self.enforcer))
        return f"{judged.verdict}: {', '.join(r.code for r in judged.reasons) or '-'}"


def inspected(container: Container, enforcer: enforce.Enforcer) -> object:
    return enforce.with_driver_view(container.inspect(), enforce.driver_memory(enforcer.last, fresh_s=60),
                                    enforce.driver_devices(enforcer, container.pod_ref.uid, container.name, fresh_s=60))


async def raw(container: Container, nbytes: int, hold_ms: int = HOLD_MS) -> Background:
    """A raw-ELF-lookup allocation past the library, held; returns once the driver gave it the memory."""
    started = await container.background([str(RAWELF), str(nbytes), str(hold_ms)])
    assert " rc=0" in await started.wait_for("alloc ")
    await started.wait_for("holding")
    return started


# --- the escapes ------------------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """What an escape started: the container it attacks from and its programs' `alloc ... rc=N` answers."""

    attacker: Container
    answers: list[str] = field(default_factory=list)

    @property
    def refused(self) -> int:
        """Allocations answered CUDA_ERROR_OUT_OF_MEMORY, and contexts the driver could not make (a cap of 0 leaves no
        room for a context's own memory)."""
        return sum(" rc=2" in line or line == SETUP_FAILED for line in self.answers)

    @property
    def allocated(self) -> int:
        return sum(" rc=0" in line for line in self.answers)


async def answers(attempt: Attempt, program: Background, count: int = 1) -> Background:
    for _ in range(count):
        attempt.answers.append(answer := await program.wait_for(("alloc ", SETUP_FAILED)))
        if answer == SETUP_FAILED:
            break  # the program ended there
    return program


def alone(name: str, argv: list[str], *, grant_written: bool = True) -> Callable[[SimNode], Awaitable[Attempt]]:
    """One program past the library in a pod of its own, under a 1 GiB grant (or none written)."""
    async def attack(node: SimNode) -> Attempt:
        tenant = await node.start(gpu_pod(name), limit="1g", grant_written=grant_written)
        attempt = Attempt(tenant)
        await answers(attempt, await tenant.background(argv))
        return attempt
    return attack


async def split(node: SimNode) -> Attempt:
    tenant = await node.start(gpu_pod("split"), limit="1g")
    attempt = Attempt(tenant)
    for _ in range(8):
        await answers(attempt, await tenant.background([str(RAWELF), str(600 * MIB), str(HOLD_MS)]))
    return attempt


async def grant_twice(node: SimNode) -> Attempt:
    tenant = await node.start(gpu_pod("doubled"), limit="1g")
    attempt = Attempt(tenant)
    for _ in range(2):
        await answers(attempt, await tenant.background([str(RAWELF), str(GIB), str(HOLD_MS)]))
    return attempt


async def relay(node: SimNode) -> Attempt:
    tenant = await node.start(gpu_pod("relay"), limit="1g")
    attempt = Attempt(tenant)
    chain = await tenant.background(["sh", "-c", f"{RAWELF} {2 * GIB} 2000; exec {RAWELF} {8 * GIB} {HOLD_MS}"])
    await answers(attempt, chain, 2)
    return attempt


async def bursts(node: SimNode) -> Attempt:
    tenant = await node.start(gpu_pod("burst"), limit="1g")
    attempt = Attempt(tenant)
    await answers(attempt, await tenant.background(["sh", "-c", f"while :; do {RAWELF} {ATTACK} 200; sleep 0.3; done"]), 10)
    return attempt


async def sidecar(node: SimNode) -> Attempt:
    containers = [{"name": "main", "image": "tenant/cuda", "command": ["train"]},
                  {"name": "sidecar", "image": "tenant/cuda", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]
    main = await node.start(gpu_pod("sidecar", containers=containers), limit="1g")
    await main.hold(512 * MIB)
    hidden = await node.start_also(main, "sidecar")
    attempt = Attempt(hidden)
    await answers(attempt, await hidden.background(RAW))
    return attempt


async def nested_cgroup(node: SimNode) -> Attempt:
    tenant = await node.start(gpu_pod("nested"), limit="1g")
    attempt = Attempt(tenant)
    dirs = " ".join(str(c / "nested") for c in tenant.process.cgroups)
    script = f'for c in {dirs}; do mkdir -p "$c" && echo $$ > "$c/cgroup.procs" || exit 1; done; exec {" ".join(RAW)}'
    await answers(attempt, await tenant.background(["sh", "-c", script]))
    return attempt


@dataclass(frozen=True)
class Escape:
    row: str  # the attack table's row (docs/security.md)
    name: str
    run: Callable[[SimNode], Awaitable[Attempt]]
    granted_bytes: int = GIB  # what the node granted every container of the attack together
    capped: bool = True  # whether a driver cap on the container's leaf reaches it


ESCAPES = [
    Escape("18", "raw ELF lookup, 4 GiB", alone("raw-elf", RAW)),
    Escape("19", "RTLD_DEEPBIND, 4 GiB", alone("deepbind", [str(DEEPBIND), str(DEEPBIND_DSO), str(ATTACK), str(HOLD_MS)])),
    Escape("20", "LD_PRELOAD shim, 4 GiB", alone("shim", ["env", f"LD_PRELOAD={SHIM}", str(CUPROBE), "init", "ctx", "0", "alloc",
                                                          str(ATTACK), "hold", str(HOLD_MS)])),
    Escape("21", "own PID namespace, 4 GiB", alone("own-pidns", ["unshare", "-Urpf", *RAW])),
    Escape("23", "split, 8 processes x 600 MiB", split),
    Escape("24", "the grant twice, 2 processes", grant_twice),
    Escape("25", "relay after a kill, 2 then 8 GiB", relay),
    Escape("26", "bursts of 0.2 s, 40 % duty", bursts),
    Escape("27", "sidecar, NVIDIA_VISIBLE_DEVICES=all", sidecar),
    Escape("28", "withheld grant", alone("withheld", RAW, grant_written=False)),
    # A limit holds exactly the cgroup it is set on (the fake as NVIDIA documents the leaf): a cgroup the tenant
    # makes below it is not capped, and the enforcer, which counts every cgroup below the container's, is the line.
    Escape("30", "nested cgroup, 4 GiB", nested_cgroup, capped=False),
]


@dataclass(frozen=True)
class Outcome:
    escape: Escape
    attempt: Attempt
    peak_over_mib: int  # the most the node's driver held past the grants (cuMemAlloc family)
    over_s: float  # how long it held more than the grants
    over_mib_s: float
    acted: bool  # the enforcer acted on the attacker


def allocated(ledger: FakeGpu) -> int:
    return ledger.stats(0)["used"]


async def run(node: SimNode, escape: Escape) -> Outcome:
    """The escape on `node`, with the enforcer looping and the ledger sampled, until WATCH_S after its last answer and
    (where the driver gave it the memory) the enforcer has acted."""
    reader = Nvml(str(node.gpu.nvml))
    shipped = Shipped(node, reader)
    try:
        async with shipped.running():
            with LedgerWatch(node.gpu, over=escape.granted_bytes, measure=allocated) as watch:
                attempt = await escape.run(node)
                deadline = time.monotonic() + 15
                await asyncio.sleep(WATCH_S)
                while allocated(node.gpu) > escape.granted_bytes and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
    finally:
        reader.close()
    return Outcome(escape, attempt, watch.peak_over_mib, watch.over_s or 0.0, watch.over_mib_s,
                   shipped.first_action(attempt.attacker) is not None)
