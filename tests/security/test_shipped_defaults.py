"""Every way a tenant kept more than its grant from the enforcer at the settings users run (issue 26):
splitting across processes, relaying after a kill, bursting between polls, and hiding (a sidecar, a
withheld grant, an init-container target, a nested cgroup). Each attack runs for real in simulated
containers against the fake driver, with the node agent's enforcer built and looping exactly as the
agent does at its shipped defaults; the fake driver's node-wide ledger is the judge. Each test adds
its row to the security table: the ledger's peak, the time to act, and the verdict."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from kai_isolator.services.nodeagent import enforce
from kai_isolator.services.nodeagent.agent import make_enforcer
from kai_isolator.services.nodeagent.nvml import Nvml
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.shared.contract import DEFAULT_GRANT_DIR, FRACTION_CONTAINER_ANNOTATION
from security.container import CONTEXT, CUPROBE, GIB, MIB, NODE, Container, SimNode, gpu_pod, record_shipped
from security.escapes import RAWELF, Shipped, inspected, raw
from support.waiting import eventually



@pytest.fixture
def driver_view(node: SimNode, monkeypatch: pytest.MonkeyPatch) -> Iterator[Nvml]:
    """The node agent's NVML: the fake one beside this node's ledger, which it answers from."""
    for knob in ("FAKE_NVML_PROCESS_API", "FAKE_NVML_GRAPHICS", "FAKE_NVML_USED"):
        monkeypatch.delenv(knob, raising=False)
    yield Nvml(str(node.gpu.nvml))


def held_by(container: Container) -> int:
    """What the driver shows the container's processes holding (its cgroup and every one below it)."""
    mine = set(container.process.pids()) | nested_pids(container)
    return sum(p.used_bytes or 0 for p in Nvml(str(container.node.gpu.nvml)).snapshot().processes if p.pid in mine)


def nested_pids(container: Container) -> set[int]:
    found: set[int] = set()
    for top in container.process.cgroups[:1]:
        for procs in top.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                found |= {int(p) for p in procs.read_text().split()}
    return found


def row(attack: str, node: SimNode, acted_s: float | None, verdict: str) -> None:
    peak = node.driver_stats()["peak"]
    record_shipped(f"{attack} [{node.driver.value}]", f"{peak >> 20} MiB", "never" if acted_s is None else f"{acted_s:.2f} s", verdict)


# --- splitting ------------------------------------------------------------------------------------


async def test_splitting_across_processes_does_not_buy_an_allowance_each(node: SimNode, driver_view: Nvml) -> None:
    """Eight processes, each under the old per-process allowance (512 MiB past a share of the grant),
    held 4.7 GiB under a 1 GiB grant without a breach: the allowance is the container's, once."""
    tenant = await node.start(gpu_pod("split"), limit="1g")
    shipped = Shipped(node, driver_view)
    allowance = shipped.settings.breach_tolerance_mib * MIB
    async with shipped.running():
        parts, held_at = [], []
        for _ in range(8):
            parts.append(await raw(tenant, 600 * MIB))
            held_at.append(time.monotonic())
        assert await eventually(lambda: shipped.first_action(tenant) is not None, 10, every_s=0.05, fail=False), f"no action; the container holds {held_by(tenant) >> 20} MiB"
        assert await eventually(lambda: held_by(tenant) <= GIB + allowance, 10, every_s=0.05, fail=False)
    _, _, breach = shipped.first_action(tenant) or (0, None, None)
    assert breach is not None and breach.action == "killed" and breach.tolerance_bytes == allowance
    # 8 x 600 MiB down to grant + one allowance; a killed process is reaped a moment after the driver frees it
    reaped = lambda: sum(p.process.returncode is not None for p in parts)  # noqa: E731
    assert await eventually(lambda: reaped() >= 6, 10, every_s=0.05, fail=False), f"{reaped()} of 8 processes ended"
    over = held_at[2]  # the third process took the container past grant + allowance (1800 of 1536 MiB)
    row("split across 8 processes", node, max(0.0, shipped.acted_at(tenant) - over), shipped.verdict(tenant))


async def test_two_processes_that_each_take_the_whole_grant_are_acted_on(node: SimNode, driver_view: Nvml) -> None:
    """The shape of every library-side escape of the "each process gets the whole grant" kind (zeroed
    counters, a deleted accounting file, a no-op slot lock): two processes holding 1 GiB each."""
    tenant = await node.start(gpu_pod("doubled"), limit="1g")
    shipped = Shipped(node, driver_view)
    async with shipped.running():
        first, second = await raw(tenant, GIB), await raw(tenant, GIB)
        held = time.monotonic()
        assert await eventually(lambda: shipped.first_action(tenant) is not None, 10, every_s=0.05, fail=False), "two whole grants, never acted on"
        assert await eventually(lambda: held_by(tenant) <= GIB + CONTEXT, 10, every_s=0.05, fail=False)  # the survivor: the grant and its context
        assert await eventually(lambda: [first.process.returncode, second.process.returncode].count(None) == 1, 10, every_s=0.05, fail=False)
    row("the grant twice (2 processes)", node, shipped.acted_at(tenant) - held, shipped.verdict(tenant))


# --- relaying -------------------------------------------------------------------------------------


async def test_a_relay_waiting_for_the_kill_is_killed_too(node: SimNode, driver_view: Nvml) -> None:
    """One process over the grant is killed; a sibling waiting for that death takes 8 GiB at once."""
    tenant = await node.start(gpu_pod("relay"), limit="1g")
    shipped = Shipped(node, driver_view)
    relay = f"{RAWELF} {2 * GIB} & wait; exec {RAWELF} {8 * GIB}"
    async with shipped.running():
        chain = await tenant.background(["sh", "-c", relay])
        await chain.wait_for("holding")
        relayed = await chain.wait_for("alloc 8", timeout_s=15)
        assert "rc=0" in relayed
        took = time.monotonic()
        kills = lambda: len([b for _, t, b in shipped.acted if t.pod.uid == tenant.pod_ref.uid and any(p.killed for p in b.processes)])  # noqa: E731
        assert await eventually(lambda: kills() >= 2, 10, every_s=0.05, fail=False), f"the relay keeps {held_by(tenant) >> 20} MiB"
        assert await eventually(lambda: held_by(tenant) == 0, 10, every_s=0.05, fail=False)
    second = [at for at, t, b in shipped.acted if t.pod.uid == tenant.pod_ref.uid][1]
    row("relay after a kill", node, max(0.0, second - took), shipped.verdict(tenant))


async def test_killing_that_does_not_bring_the_container_back_under_escalates_to_eviction(node: SimNode, driver_view: Nvml) -> None:
    tenant = await node.start(gpu_pod("relay-forever"), limit="1g")
    shipped = Shipped(node, driver_view)
    async with shipped.running():
        began = time.monotonic()
        await tenant.background(["sh", "-c", f"while :; do {RAWELF} {4 * GIB}; done"])
        def evicted_and_reported() -> bool:  # the eviction is asked for before its breach is reported: wait for both
            return bool(shipped.evicted) and any(b.action == "evicted" for _, _, b in shipped.acted)

        assert await eventually(evicted_and_reported, 20, every_s=0.05, fail=False), f"{len(shipped.acted)} kills, {len(shipped.evicted)} evictions"
    [(at, pod)] = shipped.evicted[:1]
    assert pod.uid == tenant.pod_ref.uid
    # The eviction came with a kill; a poll before the kubelet stops the pod may kill once more.
    assert [b.action for _, _, b in shipped.acted].count("evicted") == 1
    row("relay forever", node, at - began, shipped.verdict(tenant) + " (evicted)")


# --- bursting -------------------------------------------------------------------------------------


async def test_bursts_shorter_than_the_confirming_poll_are_acted_on(node: SimNode, driver_view: Nvml) -> None:
    """4 GiB over a 1 GiB grant for 0.2 s at a time, 40 % of the time: every poll that sees it counts."""
    tenant = await node.start(gpu_pod("burst"), limit="1g")
    shipped = Shipped(node, driver_view)
    async with shipped.running():
        began = time.monotonic()
        await tenant.background(["sh", "-c", f"while :; do {RAWELF} {4 * GIB} 200; sleep 0.3; done"])
        assert await eventually(lambda: shipped.first_action(tenant) is not None, 15, every_s=0.05, fail=False), "bursts past the grant were never acted on"
    _, _, breach = shipped.first_action(tenant) or (0, None, None)
    assert breach is not None and breach.measured_bytes >= 4 * GIB
    row("bursts of 0.2 s, 40 % duty", node, shipped.acted_at(tenant) - began, shipped.verdict(tenant))


# --- hiding ---------------------------------------------------------------------------------------


async def test_a_sidecar_of_a_gpu_sharing_pod_is_held_to_nothing(node: SimNode, driver_view: Nvml) -> None:
    containers = [{"name": "main", "image": "tenant/cuda", "command": ["train"]},
                  {"name": "sidecar", "image": "tenant/cuda", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]
    main = await node.start(gpu_pod("sidecar", containers=containers), limit="1g")
    kept = await main.hold(512 * MIB)
    sidecar = await node.start_also(main, "sidecar")
    shipped = Shipped(node, driver_view)
    async with shipped.running():
        hidden = await raw(sidecar, 4 * GIB)
        held = time.monotonic()
        assert await eventually(lambda: shipped.first_action(sidecar) is not None, 10, every_s=0.05, fail=False), "the sidecar keeps 4 GiB"
        assert await eventually(lambda: hidden.process.returncode is not None, 10, every_s=0.05, fail=False)
    _, _, breach = shipped.first_action(sidecar) or (0, None, None)
    assert breach is not None and breach.grant_bytes == 0 and breach.tolerance_bytes == 0
    assert kept.process.returncode is None and held_by(main) == 512 * MIB + CONTEXT  # the target keeps what its grant allows (and its context)
    row("sidecar (NVIDIA_VISIBLE_DEVICES=all)", node, shipped.acted_at(sidecar) - held, shipped.verdict(sidecar))


async def test_a_target_whose_grant_was_withheld_is_held_to_nothing(node: SimNode, driver_view: Nvml) -> None:
    tenant = await node.start(gpu_pod("withheld"), limit="1g", grant_written=False)
    shipped = Shipped(node, driver_view)
    async with shipped.running():
        hidden = await raw(tenant, 4 * GIB)
        held = time.monotonic()
        assert await eventually(lambda: shipped.first_action(tenant) is not None, 10, every_s=0.05, fail=False), "a target without a grant keeps 4 GiB"
        assert await eventually(lambda: hidden.process.returncode is not None, 10, every_s=0.05, fail=False)
    _, target, breach = shipped.first_action(tenant) or (0, None, None)
    assert target is not None and breach is not None and breach.grant_bytes == 0
    [over, _] = enforce.verdict(NODE, target, breach).reasons
    assert "no grant" in over.message
    row("withheld grant", node, shipped.acted_at(tenant) - held, shipped.verdict(tenant))


async def test_an_init_container_target_gets_the_grant_a_main_container_gets(node: SimNode, driver_view: Nvml) -> None:
    pod = gpu_pod("init-target", annotations={FRACTION_CONTAINER_ANNOTATION: "prep"})
    pod["spec"]["initContainers"] = [{"name": "prep", "image": "tenant/cuda", "command": ["prepare"]}]
    prep = await node.start(pod, limit="1g", container="prep")
    assert prep.grant_mounted and "POD_UID" in prep.env
    # The tenant's own limit in the environment: the node's grant decides, as in a main container.
    attempt = await prep.run([str(CUPROBE), "init", "ctx", "0", "alloc", str(4 * GIB)], env={**prep.env, "CUDA_DEVICE_MEMORY_LIMIT": "15g"})
    # cuprobe reports a refused allocation as "alloc <bytes> rc=2 id=-1" (CUDA_ERROR_OUT_OF_MEMORY, no slot kept).
    assert f"alloc {4 * GIB} rc=2 id=-1" in attempt.stdout.splitlines(), attempt.stdout
    shipped = Shipped(node, driver_view)
    async with shipped.running():
        kept = await prep.hold(768 * MIB)
        # Two complete polls that measured the target holding its memory, and neither acted on it.
        assert await eventually(lambda: shipped.polls_measuring(prep) >= 2, 10, every_s=0.05, fail=False), "the enforcer never measured it"
        assert kept.process.returncode is None and shipped.first_action(prep) is None
    judged = prep.judge(inspected(prep, shipped.enforcer))
    assert judged.verdict == "verified", judged.reasons
    row("init-container target", node, None, f"blocked by the library; {judged.verdict}")


@pytest.mark.parametrize("nested", ["nested", "nested-decoy"])
async def test_a_process_in_a_cgroup_below_its_containers_is_the_containers(node: SimNode, driver_view: Nvml, nested: str) -> None:
    """`nested-decoy` names its cgroup like another pod's container: the kubelet's part of the path decides."""
    tenant = await node.start(gpu_pod(nested), limit="1g")
    below = "nested" if nested == "nested" else "pod00000000-0000-0000-0000-000000000000/" + "ab" * 32
    dirs = " ".join(str(c / below) for c in tenant.process.cgroups)
    script = f'for c in {dirs}; do mkdir -p "$c" && echo $$ > "$c/cgroup.procs" || exit 1; done; exec {RAWELF} {4 * GIB}'
    shipped = Shipped(node, driver_view)
    async with shipped.running():
        hidden = await tenant.background(["sh", "-c", script])
        assert " rc=0" in await hidden.wait_for("alloc ")
        held = time.monotonic()
        assert await eventually(lambda: shipped.first_action(tenant) is not None, 10, every_s=0.05, fail=False), "a nested cgroup hides 4 GiB"
        assert await eventually(lambda: hidden.process.returncode is not None, 10, every_s=0.05, fail=False)
    row(f"{nested} cgroup", node, shipped.acted_at(tenant) - held, shipped.verdict(tenant))


# --- the verifier ---------------------------------------------------------------------------------


async def test_the_verifier_never_says_verified_while_the_driver_shows_more_than_the_grant(node: SimNode, driver_view: Nvml) -> None:
    """Every process maps the node's library and the accounting file shows nothing wrong, but the driver
    shows 4 GiB under a 1 GiB grant (a raw-ELF bypass; the enforcer only warns here, so it lasts)."""
    tenant = await node.start(gpu_pod("verify"), limit="1g")
    await raw(tenant, 4 * GIB)
    pods = enforce.KnownPods(node.root / DEFAULT_GRANT_DIR.lstrip("/"), lambda: {c.pod_ref.uid: c.pod for c in node.containers})
    watching = make_enforcer(NodeAgentSettings(node_name=NODE, on_breach="warn"), driver_view.snapshot, pods, Shipped(node, driver_view).report, None)
    await watching.poll()
    judged = tenant.judge(inspected(tenant, watching))
    assert judged.verdict == "breached" and judged.reasons[0].code == "driver-over-grant", judged.reasons
    assert f"holding {4 * GIB + CONTEXT} bytes, held to {GIB} (+{512 * MIB}" in judged.reasons[0].message  # and its context
    row("verifier: library fine, driver over", node, None, f"{judged.verdict}: {', '.join(r.code for r in judged.reasons)}")
