"""Benchmark of the node agent's enforcer on the fake driver, at its shipped defaults, with the rule it
replaced (a breach confirmed by a second poll a quarter interval later) measured in the same run as the
baseline: time from the first byte past a grant (a raw-ELF-lookup bypass in a kubelet-named cgroup) to
its kill, p50/p99; how soon bursts of 0.2 s at 40 % duty are acted on; false kills of a transient
allocation just past grant + allowance (a kernel's at the edge); CPU per poll with 1, 100 and 1,000 GPU
processes (the fake NVML's share apart from the agent's own); the agent's memory. Needs root (cgroups).
Prints figures only."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kai_isolator.services.demo.kubelet import CgroupPlacement, cgroup_hierarchies, new_container_id
from kai_isolator.services.nodeagent.agent import make_enforcer
from kai_isolator.services.nodeagent.enforce import Enforcer, KnownPods, Target
from kai_isolator.services.nodeagent.grant_files import write_grant
from kai_isolator.services.nodeagent.nvml import Nvml
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.shared.events import Breach
from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu
from kai_isolator.shared.grant import DeviceGrant, Grant, GrantSource

REPO = Path(__file__).resolve().parent.parent
HAMI = REPO / "hami-core"
RAWELF = HAMI / "build" / "tests" / "rawelf"
FANOUT = HAMI / "build" / "tests" / "fanout"
UUID0 = "GPU-0000fa4e-1111-2222-3333-000000000000"
GIB, MIB = 1 << 30, 1 << 20
KILLS = int(os.environ.get("BENCH_KILLS", "20"))
POLLS = int(os.environ.get("BENCH_POLLS", "20"))
BURSTS = int(os.environ.get("BENCH_BURST_RUNS", "5"))
EDGES = int(os.environ.get("BENCH_EDGES", "40"))
SHIPPED = NodeAgentSettings(node_name="bench")
INTERVAL_S = SHIPPED.enforce_interval_s
ALLOWANCE = SHIPPED.breach_tolerance_mib * MIB
RULES = {"any poll (shipped)": 1, "two polls (baseline)": 2}


class Node:
    """Kubelet-named cgroups, grants and pod objects for containers run directly by this benchmark."""

    def __init__(self, workdir: Path) -> None:
        self.grant_root = workdir / "grants"
        self.gpu = FakeGpu(workdir / "nvidia-driver")  # the node's fake GPU: its ledger beside the libraries
        self.placement = CgroupPlacement(prefix=f"kai-bench-{uuid.uuid4().hex[:8]}")
        self.pods: dict[str, dict[str, object]] = {}
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LD_LIBRARY_PATH": str(self.gpu.folder)}

    def container(self, name: str, limit: int) -> list[Path]:
        uid, cid = str(uuid.uuid4()), new_container_id()
        self.pods[uid] = {"metadata": {"namespace": "bench", "name": name, "uid": uid},
                          "status": {"containerStatuses": [{"name": "main", "containerID": f"containerd://{cid}"}]}}
        write_grant(self.grant_root, Grant(pod_uid=uid, namespace="bench", pod=name, container="main",
                                           devices=(DeviceGrant(uuid=UUID0, limit_bytes=limit),), source=GrantSource.CONFIGMAP))
        return self.placement.create(uid, cid)

    def start(self, cgroups: list[Path], argv: list[str]) -> subprocess.Popen[str]:
        join = 'for c in "$@"; do [ "$c" = -- ] && break; echo $$ > "$c/cgroup.procs"; shift; done; shift; exec "$@"'
        return subprocess.Popen(["sh", "-c", join, "sh", *map(str, cgroups), "--", *argv], env=self.env,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


class Acted:
    """The enforcer's reports, by pod uid."""

    def __init__(self) -> None:
        self.at: dict[str, list[float]] = {}

    async def __call__(self, target: Target, breach: Breach) -> None:
        self.at.setdefault(target.pod.uid, []).append(time.monotonic())


def shipped_enforcer(node: Node, reader: Nvml, report: Acted, polls_to_breach: int) -> Enforcer:
    enforcer = make_enforcer(SHIPPED, reader.snapshot, KnownPods(node.grant_root, lambda: node.pods), report, None)
    enforcer.polls_to_breach = polls_to_breach
    return enforcer


async def looping(enforcer: Enforcer) -> asyncio.Task[None]:
    return asyncio.create_task(enforcer.run(INTERVAL_S))


async def stop(loop: asyncio.Task[None]) -> None:
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)


async def time_to_kill(node: Node, reader: Nvml, polls_to_breach: int) -> list[float]:
    kills: list[float] = []
    loop = await looping(shipped_enforcer(node, reader, Acted(), polls_to_breach))
    try:
        for i in range(KILLS):
            await asyncio.sleep(random.uniform(0, INTERVAL_S))  # any phase against the poll loop
            proc = node.start(node.container(f"hostile-{polls_to_breach}-{i}", GIB), [str(RAWELF), str(2 * GIB)])
            assert proc.stdout is not None
            line = await asyncio.to_thread(proc.stdout.readline)
            past = time.monotonic()  # the driver has just handed it the bytes past its grant
            if "rc=0" not in line:
                raise SystemExit(f"bypass did not allocate: {line!r}")
            await asyncio.to_thread(proc.wait)
            kills.append(time.monotonic() - past)
    finally:
        await stop(loop)
    return kills


async def bursts(node: Node, reader: Nvml, polls_to_breach: int, seconds: float = 10.0) -> list[float | None]:
    """Per run: seconds until a container bursting 4 GiB past a 1 GiB grant (0.2 s on, 0.3 s off) is first acted on."""
    acted = Acted()
    found: list[float | None] = []
    loop = await looping(shipped_enforcer(node, reader, acted, polls_to_breach))
    try:
        for i in range(BURSTS):
            cgroups = node.container(f"burst-{polls_to_breach}-{i}", GIB)
            uid = next(reversed(node.pods))
            began = time.monotonic()
            proc = node.start(cgroups, ["sh", "-c", f"exec 2>/dev/null; while :; do {RAWELF} {4 * GIB} 200 >/dev/null; sleep 0.3; done"])
            while time.monotonic() - began < seconds and uid not in acted.at:
                await asyncio.sleep(0.05)
            found.append(acted.at[uid][0] - began if uid in acted.at else None)
            os.killpg(proc.pid, 9)
            proc.wait()
    finally:
        await stop(loop)
    return found


async def edge_kills(node: Node, reader: Nvml, polls_to_breach: int, hold_ms: int = 50) -> int:
    """Kills among EDGES transient allocations of 64 MiB past grant + allowance, held `hold_ms`, one a second."""
    acted = Acted()
    loop = await looping(shipped_enforcer(node, reader, acted, polls_to_breach))
    try:
        cgroups = node.container(f"edge-{polls_to_breach}", GIB)
        uid = next(reversed(node.pods))
        for _ in range(EDGES):
            proc = node.start(cgroups, [str(RAWELF), str(GIB + ALLOWANCE + 64 * MIB), str(hold_ms)])
            await asyncio.to_thread(proc.wait)
            await asyncio.sleep(random.uniform(0.5, 1.0))
    finally:
        await stop(loop)
    return len(acted.at.get(uid, []))


async def cpu_per_poll(node: Node, reader: Nvml, processes: int) -> tuple[float, float, float]:
    """(ms of CPU per poll, of which the NVML snapshot, of which the agent's own work), median of POLLS."""
    groups = []
    per_container = 100 if processes >= 100 else processes
    for i in range(max(1, processes // per_container)):
        cgroups = node.container(f"busy-{processes}-{i}", 15 * GIB)
        group = node.start(cgroups, [str(FANOUT), str(per_container), str(MIB)])
        groups.append(group)
    for group in groups:
        assert group.stdout is not None
        line = await asyncio.to_thread(group.stdout.readline)
        if not line.startswith("ready"):
            raise SystemExit(f"fanout failed: {line!r}")

    enforcer = shipped_enforcer(node, reader, Acted(), 1)
    totals, snaps = [], []
    try:
        for _ in range(POLLS):
            began = time.process_time()
            poll = await enforcer.poll()
            totals.append((time.process_time() - began) * 1000)
            began = time.process_time()
            snapshot = await asyncio.to_thread(reader.snapshot)
            snaps.append((time.process_time() - began) * 1000)
            assert poll.ok and sum(len(m.processes) for m in poll.measures) == processes, (poll.error, len(snapshot.processes))
    finally:
        for group in groups:
            os.killpg(group.pid, 9)
            group.wait()
    total, snap = statistics.median(totals), statistics.median(snaps)
    return total, snap, max(0.0, total - snap)


async def main() -> int:
    if os.geteuid() != 0 or not cgroup_hierarchies():
        print("bench/enforcer.py needs root and a writable cgroup hierarchy (kubelet-named cgroups); skipped")
        return 0
    logging.disable(logging.WARNING)  # each kill is logged; the figures are what this prints
    subprocess.run(["make", "-s", "-C", str(HAMI)], check=True)
    with tempfile.TemporaryDirectory(prefix="kai-bench-enforcer-") as tmp:
        node = Node(Path(tmp))
        node.gpu.start()
        reader = Nvml(str(node.gpu.nvml))
        try:
            print(f"shipped defaults: interval {INTERVAL_S:g} s (each gap drawn from 0.5-1.5x), allowance {ALLOWANCE >> 20} MiB per container")
            p99: dict[str, float] = {}
            for rule, polls in RULES.items():
                kills = await time_to_kill(node, reader, polls)
                p99[rule] = percentile(kills, 99)
                print(f"first byte past the grant -> killed, {rule}, {len(kills)} bypasses: p50 {percentile(kills, 50) * 1000:.0f} ms, "
                      f"p99 {p99[rule] * 1000:.0f} ms, max {max(kills) * 1000:.0f} ms")
            shipped, baseline = RULES
            print(f"  p99 ratio shipped/baseline: {p99[shipped] / p99[baseline]:.2f}")
            for rule, polls in RULES.items():
                runs = await bursts(node, reader, polls)
                caught = [t for t in runs if t is not None]
                when = f", first action after median {statistics.median(caught):.1f} s" if caught else ""
                print(f"bursts of 0.2 s at 40 % duty, 4 GiB past a 1 GiB grant, {rule}: acted on in {len(caught)} of {len(runs)} runs "
                      f"of 10 s{when}")
            for rule, polls in RULES.items():
                kills_at_edge = await edge_kills(node, reader, polls)
                print(f"transient 50 ms allocations 64 MiB past grant + allowance, {rule}: {kills_at_edge} of {EDGES} killed "
                      f"({kills_at_edge / EDGES:.0%}; a poll lands in one with p = 50 ms / {INTERVAL_S:g} s = {0.05 / INTERVAL_S:.0%})")
            for processes in (1, 100, 1000):
                total, snap, own = await cpu_per_poll(node, reader, processes)
                print(f"CPU per poll, {processes:>4} GPU processes: {total:7.2f} ms (fake NVML snapshot {snap:6.2f} ms, "
                      f"agent's attribution and comparison {own:6.2f} ms, {own / snap if snap else 0:.2f}x the snapshot)")
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"agent memory: peak RSS of this enforcer process {rss:.1f} MiB (Python, ctypes NVML, state for 1,000 processes)")
        finally:
            await asyncio.to_thread(node.placement.remove)
            node.gpu.stop()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
