"""Bypasses the library cannot see, run for real in simulated containers, each stopped by the node agent's
enforcer from the driver's own view (the fake NVML's per-process queries on the node-wide ledger, by host
PID, attributed by kubelet cgroup): the tenant's process is killed on the first poll that sees it, a
well-behaved neighbour on the same fake GPU keeps its memory, and nothing is ever killed on a partial view.
These run with no allowance (tolerance 0) so that every figure is exact; test_shipped_defaults.py runs
every attack class at the settings users run."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.nodeagent import enforce
from kai_isolator.services.nodeagent.agent import NodeAgent
from kai_isolator.services.nodeagent.enforce import Enforcer, KnownPods, Target
from kai_isolator.services.nodeagent.nvml import Nvml, NvmlError
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.cgroups import container_of_pid
from kai_isolator.shared.contract import DEFAULT_GRANT_DIR
from kai_isolator.shared.events import Breach, HealthVerdict, InspectRequest, decode
from kai_isolator.shared.settings import BusSettings
from security.container import (
    BUILD, CONTEXT, CUPROBE, FAKE_DIR, GIB, MIB, Background, Container, SimNode, decoy_library, gpu_pod, record_outcome, tenant_grant,
)

RAWELF = BUILD / "tests" / "rawelf"
DEEPBIND = BUILD / "tests" / "deepbind"
DEEPBIND_DSO = BUILD / "tests" / "libdeepbind.so"
SHIM = BUILD / "tests" / "libshim.so"
FAKE_NVML = FAKE_DIR / "libnvidia-ml.so.1"  # the build's copy, with no ledger beside it
HOLD = ["hold", "600000"]
ATTACK = 4 * GIB  # what each hostile tenant took under a 1 GiB grant before the enforcer


@pytest.fixture
def driver_view(node: SimNode, monkeypatch: pytest.MonkeyPatch) -> Iterator[Nvml]:
    """The node agent's NVML: the fake one beside this node's ledger, which it answers from."""
    for knob in ("FAKE_NVML_PROCESS_API", "FAKE_NVML_GRAPHICS", "FAKE_NVML_USED"):
        monkeypatch.delenv(knob, raising=False)
    reader = Nvml(str(node.gpu.nvml))
    yield reader


class Reports:
    """What the enforcer told the world, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[Target, Breach]] = []

    async def __call__(self, target: Target, breach: Breach) -> None:
        self.seen.append((target, breach))


def enforcer_for(node: SimNode, reader: Nvml, reports: Reports, **options: object) -> Enforcer:
    """The agent's enforcer on this node: the pods the kubelet runs, the grants the node wrote."""
    pods = KnownPods(node.root / DEFAULT_GRANT_DIR.lstrip("/"), lambda: {c.pod_ref.uid: c.pod for c in node.containers})
    return Enforcer(reader.snapshot, pods, reports, **options)  # type: ignore[arg-type]


async def attack(container: Container, how: str, tmp_path: Path) -> Background:
    """Start one bypass of the library inside `container`, past its grant; returns once it holds the memory."""
    if how == "raw-elf-lookup":
        argv = [str(RAWELF), str(ATTACK)]
    elif how == "rtld-deepbind":
        argv = [str(DEEPBIND), str(DEEPBIND_DSO), str(ATTACK)]
    elif how == "ld-preload-shim":
        # The tenant's own shim ahead of /etc/ld.so.preload; the application is unmodified.
        argv = ["env", f"LD_PRELOAD={SHIM}", str(CUPROBE), "init", "ctx", "0", "alloc", str(ATTACK), *HOLD]
    elif how == "user-namespace-decoy":
        decoy = decoy_library(tmp_path / "tenant")
        script = f'mount --bind {decoy} /usr/local/vgpu/libvgpu.so && exec "$@"'
        argv = ["unshare", "-Urm", "sh", "-c", script, "sh", str(CUPROBE), "init", "ctx", "0", "alloc", str(ATTACK), *HOLD]
    elif how == "user-namespace-grant":
        # Its own grant.json (15 GiB) mounted over the node's read-only grant: the library obeys it.
        script = f'mount --bind {tenant_grant(tmp_path / "tenant-grant")} /etc/kai-isolator && exec "$@"'
        argv = ["unshare", "-Urm", "sh", "-c", script, "sh", str(CUPROBE), "init", "ctx", "0", "alloc", str(ATTACK), *HOLD]
    elif how == "own-pid-namespace":
        # The fake driver then records pid 1: the enforcer must still find and kill the host process.
        argv = ["unshare", "-Urpf", str(RAWELF), str(ATTACK)]
    else:
        raise AssertionError(how)
    started = await container.background(argv)
    line = await started.wait_for("alloc ")
    assert " rc=0" in line, f"{how}: the bypass did not get past the library: {line}"
    await started.wait_for("holding")
    return started


def holders(node: SimNode, container: Container) -> list[int]:
    """Host pids of the container that the driver shows holding memory (the fake NVML, as the agent reads it)."""
    mine = set(container.process.pids())
    return sorted(p.pid for p in Nvml(str(node.gpu.nvml)).snapshot().processes if p.pid in mine)


async def exited_by_sigkill(program: Background, timeout_s: float = 10) -> bool:
    code = await asyncio.wait_for(program.process.wait(), timeout_s)
    # The kill reaches the process the driver lists; a wrapper around it (unshare -f) may report that
    # as 128+9, or, as PID 1 of its own namespace dying takes the rest with it, its own exit status.
    return code in (-signal.SIGKILL, 128 + signal.SIGKILL) or (code != 0 and "holding" in program.lines)


ATTACKS = ["raw-elf-lookup", "rtld-deepbind", "ld-preload-shim", "user-namespace-decoy", "user-namespace-grant", "own-pid-namespace"]


@pytest.mark.parametrize("how", ATTACKS)
async def test_a_bypass_is_killed_and_the_neighbour_keeps_its_memory(node: SimNode, driver_view: Nvml, tmp_path: Path, how: str) -> None:
    neighbour = await node.start(gpu_pod("neighbour"), limit="1g")
    kept = await neighbour.hold(768 * MIB)
    tenant = await node.start(gpu_pod(f"hostile-{how}"), limit="1g")
    bypass = await attack(tenant, how, tmp_path)
    assert node.driver_used() == ATTACK + 768 * MIB  # the driver really gave it all

    reports = Reports()
    enforcer = enforcer_for(node, driver_view, reports, tolerance_bytes=0)
    # Issue 26: one complete poll over the grant is a breach (it was two, so bursts between them went unseen).
    first = await enforcer.poll()
    [measure] = [m for m in first.measures if m.target.pod.uid == tenant.pod_ref.uid]
    assert first.ok and measure.used_bytes == ATTACK + CONTEXT and measure.limit_bytes == GIB
    assert [t.pod.uid for t, _ in first.breaches] == [tenant.pod_ref.uid]

    assert await exited_by_sigkill(bypass)
    [(target, breach)] = reports.seen
    assert (target.pod.name, target.container) == (tenant.pod_ref.name, "main")
    assert breach.action == "killed" and breach.action_ok and breach.grant_bytes == GIB and breach.measured_bytes == ATTACK + CONTEXT
    assert [p.used_bytes for p in breach.processes] == [ATTACK + CONTEXT] and all(p.killed for p in breach.processes)
    verdict = enforce.verdict("gpu-node-sec", target, breach)
    assert verdict.verdict == "breached" and [r.code for r in verdict.reasons] == ["over-grant", "killed"]

    # The neighbour on the same GPU: still running, still holding exactly what it held.
    assert kept.process.returncode is None and node.driver_used() == 768 * MIB
    assert holders(node, neighbour) and not holders(node, tenant)
    third = await enforcer.poll()
    assert not third.breaches and len(reports.seen) == 1
    record_outcome(f"{how} [{node.driver.value}]", f"killed by the enforcer ({ATTACK >> 20} MiB of {GIB >> 20})",
                   f"breached: {', '.join(r.code for r in verdict.reasons)}")


async def test_kill_stops_at_the_grant_biggest_first_and_one_breach_is_acted_on_once(node: SimNode, driver_view: Nvml) -> None:
    tenant = await node.start(gpu_pod("many"), limit="1g")
    small = await tenant.hold(512 * MIB)  # within the grant, through the library
    big = await tenant.background([str(RAWELF), str(2 * GIB)])
    await big.wait_for("holding")
    reports = Reports()
    enforcer = enforcer_for(node, driver_view, reports, tolerance_bytes=0)
    await enforcer.poll()
    await enforcer.poll()
    assert await exited_by_sigkill(big)
    # 2.5 GiB held; killing the 2 GiB process brings it to 512 MiB, under the grant: the small one lives.
    assert small.process.returncode is None and node.driver_used() == 512 * MIB
    [(_, breach)] = reports.seen
    assert [(p.used_bytes, p.killed) for p in breach.processes] == [(2 * GIB + CONTEXT, True), (512 * MIB + CONTEXT, False)]
    for _ in range(3):
        await enforcer.poll()
    assert len(reports.seen) == 1


@pytest.mark.parametrize("mode", ["warn", "evict"])
async def test_warn_and_evict_act_once_per_breach_however_long_it_lasts(node: SimNode, driver_view: Nvml, mode: str) -> None:
    tenant = await node.start(gpu_pod(f"long-{mode}"), limit="1g")
    bypass = await attack(tenant, "raw-elf-lookup", Path("/nonexistent"))
    evictions: list[str] = []

    async def evict(pod: object) -> bool:
        evictions.append(str(pod))
        return True

    reports = Reports()
    enforcer = enforcer_for(node, driver_view, reports, tolerance_bytes=0, on_breach=mode, evict=evict)
    for _ in range(6):
        await enforcer.poll()
    assert bypass.process.returncode is None  # neither mode kills
    assert [b.action for _, b in reports.seen] == ["warned" if mode == "warn" else "evicted"]
    assert len(evictions) == (1 if mode == "evict" else 0)


async def test_the_tolerance_for_context_reservations_is_per_container(node: SimNode, driver_view: Nvml) -> None:
    """Issue 26: the allowance was per process, so splitting the work across processes bought one each."""
    tenant = await node.start(gpu_pod("tolerated"), limit="1g")
    # What NVML charges each process is its allocation and its context's overhead.
    bypass = await tenant.background([str(RAWELF), str(GIB + 256 * MIB - CONTEXT)])
    await bypass.wait_for("holding")
    reports = Reports()
    enforcer = enforcer_for(node, driver_view, reports, tolerance_bytes=256 * MIB)
    for _ in range(3):
        await enforcer.poll()
    assert not reports.seen and bypass.process.returncode is None  # exactly grant + one context's allowance
    more = await tenant.background([str(RAWELF), str(256 * MIB - CONTEXT)])  # a second process: no more allowance, 256 MiB more held
    await more.wait_for("holding")
    await enforcer.poll()
    await enforcer.poll()
    [(_, breach)] = reports.seen
    assert breach.measured_bytes == GIB + 512 * MIB and breach.tolerance_bytes == 256 * MIB
    assert [p.killed for p in breach.processes] == [True, False]  # the bigger one goes; the rest is within grant + allowance


async def test_only_the_breaching_containers_processes_are_ever_killed(node: SimNode, driver_view: Nvml) -> None:
    tenant = await node.start(gpu_pod("over"), limit="1g")
    bypass = await attack(tenant, "raw-elf-lookup", Path("/nonexistent"))
    big_neighbour = await node.start(gpu_pod("big", gpu_memory="8192"), limit="8g")
    heavy = await big_neighbour.hold(6 * GIB)  # more than the breaching one holds, but within its own grant
    outsider = subprocess.Popen([str(RAWELF), str(2 * GIB)], env={"PATH": os.environ["PATH"], **node.driver_env},
                                stdout=subprocess.PIPE, text=True)
    try:
        assert outsider.stdout is not None and "rc=0" in outsider.stdout.readline()
        reports = Reports()
        enforcer = enforcer_for(node, driver_view, reports, tolerance_bytes=0)
        await enforcer.poll()
        poll = await enforcer.poll()
        assert await exited_by_sigkill(bypass)
        assert heavy.process.returncode is None and outsider.poll() is None
        # A host process in no container is reported, never touched.
        assert [(u.pid, u.why) for u in poll.unattributed] == [(outsider.pid, "not in a kubelet container cgroup")]
        # The kill itself refuses a process that is not in the breaching container, whatever it was asked.
        owner = container_of_pid(tenant.process.pid)
        assert owner is not None
        victim = [p for p in big_neighbour.process.pids() if enforce.start_time(Path("/proc"), p) is not None][-1]
        asked = enforce.Identity(victim, enforce.start_time(Path("/proc"), victim) or 0)
        assert enforce.kill_verified(Path("/proc"), asked, owner) == "left-the-container"
        assert heavy.process.returncode is None and node.driver_used() == 6 * GIB + 2 * GIB
    finally:
        outsider.kill()
        outsider.wait()


async def test_a_reused_pid_is_never_killed(node: SimNode) -> None:
    tenant = await node.start(gpu_pod("reuse"), limit="1g")
    sleeper = await tenant.background(["sh", "-c", "echo started; exec sleep 600"])
    await sleeper.wait_for("started")
    pid = sleeper.process.pid  # nsenter and the cgroup join exec into the program: one process
    owner = container_of_pid(pid)
    assert owner is not None
    started = enforce.start_time(Path("/proc"), pid)
    assert started is not None
    # The identity the enforcer attributed was an earlier process with this PID: a different start time.
    assert enforce.kill_verified(Path("/proc"), enforce.Identity(pid, started - 1), owner) == "not-the-same-process"
    assert sleeper.process.returncode is None and Path(f"/proc/{pid}").exists()
    assert enforce.kill_verified(Path("/proc"), enforce.Identity(pid, started), owner) == "killed"
    await asyncio.wait_for(sleeper.process.wait(), 10)
    assert enforce.kill_verified(Path("/proc"), enforce.Identity(pid, started), owner) in ("gone", "not-the-same-process")


@pytest.mark.parametrize("failure", ["nvml-missing", "no-driver-view", "memory-withheld"])
async def test_nothing_is_killed_on_a_partial_view(node: SimNode, driver_view: Nvml, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    tenant = await node.start(gpu_pod(f"blind-{failure}"), limit="1g")
    bypass = await attack(tenant, "raw-elf-lookup", Path("/nonexistent"))
    reports = Reports()
    snapshot = driver_view.snapshot
    if failure == "nvml-missing":
        def snapshot() -> enforce.DriverSnapshot:
            return Nvml(str(FAKE_DIR / "no-such-libnvidia-ml.so.1")).snapshot()
    elif failure == "no-driver-view":
        def snapshot() -> enforce.DriverSnapshot:  # no ledger beside this copy: NVML_ERROR_NOT_SUPPORTED
            return Nvml(str(FAKE_NVML)).snapshot()
    else:
        monkeypatch.setenv("FAKE_NVML_USED", "unavailable")  # NVML_VALUE_NOT_AVAILABLE for every process
    pods = KnownPods(node.root / DEFAULT_GRANT_DIR.lstrip("/"), lambda: {c.pod_ref.uid: c.pod for c in node.containers})
    enforcer = Enforcer(snapshot, pods, reports, tolerance_bytes=0)
    polls = [await enforcer.poll() for _ in range(4)]
    assert not reports.seen and bypass.process.returncode is None
    if failure == "memory-withheld":
        assert all(p.ok for p in polls) and all(not m.complete for p in polls for m in p.measures)
    else:
        assert not any(p.ok for p in polls) and all(p.error for p in polls) and not enforcer.healthy
    with pytest.raises(NvmlError):
        Nvml(str(FAKE_DIR / "no-such-libnvidia-ml.so.1"))


# --- the whole agent: verdict on the bus, Event on the pod, metric ---------------------------------------


@pytest.fixture
def dev_cluster_options() -> dict[str, Any]:
    """The real API server knows this node (its simulated kubelet registers it); no pod of it is in the API."""
    return {"nodes": {"gpu-node-sec": 15360}, "step_s": 0.02}


async def breach_events(cluster: DevCluster, namespace: str, timeout_s: float = 10) -> list[dict[str, Any]]:
    """The IsolationBreached Events in `namespace`, once there is one (posted right after the verdict is published)."""
    deadline = time.monotonic() + timeout_s
    while not (found := [e for e in await cluster.list("events", namespace) if e.get("reason") == "IsolationBreached"]):
        assert time.monotonic() < deadline, f"no IsolationBreached Event in {namespace}"
        await asyncio.sleep(0.05)
    return found


async def test_the_agent_kills_publishes_breached_posts_the_event_and_counts(
        node: SimNode, driver_view: Nvml, dev_cluster: DevCluster, bus_settings: BusSettings) -> None:
    neighbour = await node.start(gpu_pod("calm"), limit="1g")
    kept = await neighbour.hold(512 * MIB)
    tenant = await node.start(gpu_pod("agent-hostile"), limit="1g")
    settings = NodeAgentSettings(node_name="gpu-node-sec", host_root=node.root, library=[], install_on_start=False,
                                 status_interval_s=3600, usage_interval_s=3600, kubeconfig=dev_cluster.kubeconfig,
                                 enforce_interval_s=0.2, breach_tolerance_mib=0, nvml_library=str(node.gpu.nvml))
    await dev_cluster.ensure_namespace(tenant.pod_ref.namespace)  # the tenant's namespace exists, as it does wherever its pods run
    agent = NodeAgent(settings, bus_settings, probe_listen="127.0.0.1:0")
    assert agent.enforcer is not None
    # The simulated containers are not pods in the API; the enforcer learns them as the agent's pod watch would.
    agent.enforcer.pods = KnownPods(agent.grant_root, lambda: {c.pod_ref.uid: c.pod for c in node.containers})
    nc = await nats.connect(bus_settings.nats_url or "")
    verdicts = await nc.subscribe(subjects.health(tenant.pod_ref.namespace, tenant.pod_ref.name))
    await agent.start(bus_settings.nats_url or "")
    try:
        bypass = await attack(tenant, "raw-elf-lookup", Path("/nonexistent"))
        _, published = decode((await verdicts.next_msg(timeout=15)).data)
        assert isinstance(published, HealthVerdict) and published.verdict == "breached" and published.breach is not None
        assert published.breach.action == "killed" and published.container == "main"
        assert await exited_by_sigkill(bypass)
        assert kept.process.returncode is None and node.driver_used() == 512 * MIB

        [event] = await breach_events(dev_cluster, tenant.pod_ref.namespace)
        assert event["type"] == "Warning" and event["involvedObject"]["name"] == tenant.pod_ref.name and "over-grant" in event["message"]
        async with aiohttp.ClientSession() as http, http.get(f"{agent.runtime.probe_url}/metrics") as response:
            metrics = await response.text()
        assert (f'kai_isolator_breaches_total{{action="killed",container="main",namespace="{tenant.pod_ref.namespace}",'
                f'pod="{tenant.pod_ref.name}"}} 1.0') in metrics
        assert "kai_isolator_nvml_up 1.0" in metrics
        reply = await agent.on_inspect(neighbour_request(neighbour))
        # The driver's figure: its allocation and its context, as NVML charges the process.
        assert reply.driver_view and [p.device_memory_bytes for p in reply.processes if p.device_memory_bytes] == [512 * MIB + CONTEXT]
        usage = await agent.report_usage()
        assert [(u.source, [d.used_bytes for d in u.devices]) for u in usage if u.pod.uid == neighbour.pod_ref.uid] == [
            ("driver", [512 * MIB + CONTEXT])]
    finally:
        await nc.close()
        await agent.stop()


def neighbour_request(container: Container) -> InspectRequest:
    return InspectRequest(node_name="gpu-node-sec", pod=container.pod_ref, container=container.name, container_id=container.container_id)


async def test_the_verifier_sees_memory_held_without_the_library_as_missing(node: SimNode, driver_view: Nvml, tmp_path: Path) -> None:
    tenant = await node.start(gpu_pod("no-library"), limit="1g")
    await attack(tenant, "user-namespace-decoy", tmp_path)  # maps a file named libvgpu.so that is not the node's
    enforcer = enforcer_for(node, driver_view, Reports(), on_breach="warn")
    memory = enforce.driver_memory(await enforcer.poll(), fresh_s=60)
    assert memory is not None
    judgement = tenant.judge(enforce.with_driver_view(tenant.inspect(), memory))
    assert judgement.verdict == "missing" and "process-without-library" in [r.code for r in judgement.reasons]
    # Without the driver's view the same container is only degraded (its cache shows nothing wrong).
    assert tenant.judge().verdict == "degraded"


# Escapes the library only detects (tests/security/test_detection.py): the accounting file deleted,
# replaced or moved aside under a process that holds memory, so a newcomer starts from an empty file;
# and an empty /etc/ld.so.preload mounted from a user namespace, so the library is not loaded at all.
DETECTED_ONLY = {
    "accounting-file-deleted": "import os; os.unlink(P)",
    "accounting-file-replaced": "import os, shutil; shutil.copyfile(P, P + '.new'); os.rename(P + '.new', P)",
    "accounting-file-moved-aside": "import os; os.rename(P, P + '.old')",
}


@pytest.mark.parametrize("how", sorted(DETECTED_ONLY))
async def test_a_tampered_accounting_file_is_held_to_the_grant_by_the_enforcer(node: SimNode, driver_view: Nvml, how: str) -> None:
    tenant = await node.start(gpu_pod(f"tamper-{how}"), limit="1g")
    first = await tenant.hold(768 * MIB)
    tamper = await tenant.run(["python3", "-c", f"P = '/run/kai-isolator/usage.cache'; {DETECTED_ONLY[how]}"])
    assert tamper.returncode == 0, tamper.stderr
    second = await tenant.hold(768 * MIB)  # through the library: the new file shows nothing held
    assert node.driver_used() == 1536 * MIB
    reports = Reports()
    enforcer = enforcer_for(node, driver_view, reports, tolerance_bytes=0)
    await enforcer.poll()
    await enforcer.poll()
    [(_, breach)] = reports.seen
    assert breach.action == "killed" and breach.measured_bytes == 1536 * MIB + 2 * CONTEXT and breach.grant_bytes == GIB
    killed = [program for program in (first, second) if await _ended(program)]
    assert len(killed) == 1 and node.driver_used() == 768 * MIB  # one of the two, and the grant holds again
    record_outcome(f"{how} [{node.driver.value}]", "killed by the enforcer (1536 MiB of 1024)", "breached: over-grant, killed")


async def test_an_empty_preload_from_a_user_namespace_is_killed_past_the_grant(node: SimNode, driver_view: Nvml, tmp_path: Path) -> None:
    tenant = await node.start(gpu_pod("empty-preload"), limit="1g")
    empty = tmp_path / "empty"
    empty.write_text("")
    script = f'mount --bind {empty} /etc/ld.so.preload && exec "$@"'
    bypass = await tenant.background(["unshare", "-Urm", "sh", "-c", script, "sh", str(CUPROBE), "init", "ctx", "0", "alloc", str(ATTACK), *HOLD])
    assert " rc=0" in await bypass.wait_for("alloc ")  # no library in that process at all
    await bypass.wait_for("holding")
    reports = Reports()
    enforcer = enforcer_for(node, driver_view, reports, tolerance_bytes=0)
    await enforcer.poll()
    await enforcer.poll()
    assert await exited_by_sigkill(bypass) and node.driver_used() == 0
    record_outcome(f"empty-preload [{node.driver.value}]", f"killed by the enforcer ({ATTACK >> 20} MiB of 1024)", "breached: over-grant, killed")


async def _ended(program: Background) -> bool:
    try:
        await asyncio.wait_for(program.process.wait(), 5)
    except asyncio.TimeoutError:
        return False
    return True
