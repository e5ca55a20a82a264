"""Attacks on the limit itself, run for real in simulated containers: with the node-written grant
mounted, nothing the tenant does to its environment (before exec or in-process), to which device
it calls ordinal 0, or to its accounting path moves the limit. A grant that is missing or not a
grant closes every device. Each ends blocked against the fake driver's own node-wide counters."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kai_isolator.shared.contract import DEFAULT_GRANT_DIR, GRANT_FILE
from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu
from security.container import CUPROBE, FAKE_GPU_UUID, GIB, MIB, Container, SimNode, blocked_or_detected, gpu_pod, tenant_grant

HOLD = ["hold", "600000"]

# What a tenant's own code does before its first CUDA call, in-process (no new exec, no new env).
IN_PROCESS = {
    "unset-limit-private-cache": ["unsetenv", "CUDA_DEVICE_MEMORY_LIMIT", "setenv", "CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/{n}.cache"],
    "raise-limit": ["setenv", "CUDA_DEVICE_MEMORY_LIMIT", "15g", "setenv", "CUDA_DEVICE_MEMORY_LIMIT_0", "15g"],
    "visible-devices": ["setenv", "CUDA_VISIBLE_DEVICES", "{visible}"],
}
VISIBLE = ["0", "GPU-0000fa4e", FAKE_GPU_UUID, "0,1"]  # every way of naming the one card, per process


def attack(how: str, n: int, nbytes: int) -> list[str]:
    steps = [step.format(n=n, visible=VISIBLE[n % len(VISIBLE)]) for step in IN_PROCESS[how]]
    return [str(CUPROBE), *steps, "init", "ctx", "0", "alloc", str(nbytes), *HOLD]


@pytest.mark.parametrize("how", sorted(IN_PROCESS))
async def test_in_process_environment_changes_do_not_move_the_grant(node: SimNode, how: str) -> None:
    container = await node.start(gpu_pod(f"env-{how}"), limit="1g")
    results = []
    for n in range(4):  # four processes, each rewriting its own environment, each asking for 768 MiB
        process = await container.background(attack(how, n, 768 * MIB))
        results.append(await process.wait_for("alloc "))
    assert " rc=0" in results[0] and all(" rc=2" in line for line in results[1:]), results
    assert blocked_or_detected(container, GIB) == "blocked"
    assert container.judge().verdict == "verified"  # nothing escaped, so nothing to report


async def test_a_device_outside_the_grant_fails_closed(node: SimNode) -> None:
    container = await node.start(gpu_pod("other-device"), limit="1g")
    with FakeGpu(node.scratch / "two-gpus", devices=2) as card:  # a node with a second device the grant does not name
        two_gpus = {**container.env, "LD_LIBRARY_PATH": str(card.folder), "CUDA_VISIBLE_DEVICES": "0,1"}
        result = await container.run([str(CUPROBE), "init", "ctx", "1", "alloc", str(MIB), "ctx", "0", "alloc", str(MIB), "fake", "1"],
                                     env=two_gpus)
    allocs = [line for line in result.stdout.splitlines() if line.startswith("alloc ")]
    assert " rc=2" in allocs[0] and " rc=0" in allocs[1], result.stdout  # device 1 is not granted; device 0 is
    assert "is not in the grant" in result.stderr
    assert "fake 1 used=0 peak=0 " in result.stdout  # nothing ever reached the ungranted device


async def test_a_grant_that_never_comes_fails_closed(node: SimNode) -> None:
    container = await node.start(gpu_pod("no-grant"), limit="1g", grant_written=False)
    impatient = {**container.env, "VGPU_GRANT_WAIT_SECONDS": "1"}
    result = await container.run([str(CUPROBE), "init", "ctx", "0", "alloc", str(MIB), "alloc", str(MIB)], env=impatient)
    assert [line.split(" id=")[0] for line in result.stdout.splitlines() if line.startswith("alloc ")] == [f"alloc {MIB} rc=2"] * 2
    assert result.stderr.count(f"no grant at /etc/kai-isolator/{GRANT_FILE}") == 1, result.stderr  # said once
    assert node.driver_stats()["peak"] == 0


async def test_a_grant_written_while_the_library_waits_is_obeyed(node: SimNode) -> None:
    container = await node.start(gpu_pod("late-grant"), limit="1g", grant_written=False)
    told = {**container.env, "LIBCUDA_LOG_LEVEL": "3"}  # INFO: the library says when it starts waiting for the grant
    waiting = await container.background([str(CUPROBE), "init", "ctx", "0", "alloc", str(512 * MIB), "alloc", str(768 * MIB), *HOLD], env=told)
    await waiting.wait_for(f"s for the grant at /etc/kai-isolator/{GRANT_FILE}")
    assert not any(line.startswith("alloc ") for line in waiting.lines), waiting.lines  # nothing allocated before the grant
    node.write_grant(container.pod, container.name, container.limit)
    assert re.search(r"found the grant after \d+ ms", await waiting.wait_for("found the grant after"))  # how long it waited
    assert " rc=0" in await waiting.wait_for(f"alloc {512 * MIB}")
    assert " rc=2" in await waiting.wait_for(f"alloc {768 * MIB}")  # 512 + 768 MiB is past the 1 GiB grant
    assert blocked_or_detected(container, GIB) == "blocked"


MALFORMED = {
    "empty": "",
    "truncated": '{"version":1,"devices":[{"uuid":"' + FAKE_GPU_UUID + '","limit_bytes":1073741824}',
    "no-devices": '{"version":1,"devices":[]}',
    "other-version": '{"version":2,"devices":[{"uuid":"' + FAKE_GPU_UUID + '","limit_bytes":1073741824}]}',
    "float-limit": '{"version":1,"devices":[{"uuid":"' + FAKE_GPU_UUID + '","limit_bytes":1.5e9}]}',
    "negative-limit": '{"version":1,"devices":[{"uuid":"' + FAKE_GPU_UUID + '","limit_bytes":-1}]}',
    "no-uuid": '{"version":1,"devices":[{"limit_bytes":1073741824}]}',
    "unknown-field": '{"version":1,"devices":[{"uuid":"' + FAKE_GPU_UUID + '","limit_bytes":1073741824,"unlimited":true}]}',
    "trailing": '{"version":1,"devices":[{"uuid":"' + FAKE_GPU_UUID + '","limit_bytes":1073741824}]} {}',
}


@pytest.mark.parametrize("how", sorted(MALFORMED))
async def test_a_malformed_grant_fails_closed(node: SimNode, how: str) -> None:
    container = await node.start(gpu_pod(f"bad-grant-{how}"), limit="1g", grant_written=False)
    grant_path(node, container).write_text(MALFORMED[how])
    result = await container.run([str(CUPROBE), "init", "ctx", "0", "alloc", str(MIB)])
    assert f"alloc {MIB} rc=2" in result.stdout and "is malformed" in result.stderr, (result.stdout, result.stderr)
    assert node.driver_stats()["peak"] == 0


def grant_path(node: SimNode, container: Container) -> Path:
    directory = node.root / DEFAULT_GRANT_DIR.lstrip("/") / f"{container.pod_ref.uid}_{container.name}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / GRANT_FILE


async def test_a_grant_remounted_from_a_user_namespace_is_not_the_nodes(node: SimNode, tmp_path: Path) -> None:
    # Without a seccomp profile the tenant can make a user namespace and mount a grant of its own
    # over the node's; the library then obeys it, so this is for the agent to see (and the enforcer,
    # which reads the node's own grant, to kill: tests/security/test_enforcer.py).
    container = await node.start(gpu_pod("forged-grant"), limit="1g")
    script = f'mount --bind {tenant_grant(tmp_path / "tenant")} /etc/kai-isolator && exec "$@"'
    forged = await container.background(["unshare", "-Urm", "sh", "-c", script, "sh",
                                         str(CUPROBE), "init", "ctx", "0", "alloc", str(2 * GIB), *HOLD])
    assert " rc=0" in await forged.wait_for("alloc ")
    await forged.wait_for("holding")
    reply = container.inspect()
    assert [p.grant_mounted for p in reply.processes if p.pid != container.process.pid] == [False]
    assert blocked_or_detected(container, GIB, "limit-from-env") == "detected"
