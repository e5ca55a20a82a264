"""Attacks on detection, run for real in simulated containers: the node agent knows the library by
device and inode (never its name) and the container by its kubelet cgroup (never its environment),
and notices an accounting file changed behind the library's back. Each ends blocked or detected."""

from __future__ import annotations

from pathlib import Path

import pytest

from security.container import CUPROBE, GIB, MIB, SimNode, blocked_or_detected, decoy_library, gpu_pod

HOLD = ["hold", "600000"]


async def test_decoy_library_mounted_from_a_user_namespace_is_library_not_ours(node: SimNode, tmp_path: Path) -> None:
    container = await node.start(gpu_pod("decoy"), limit="1g")
    decoy = decoy_library(tmp_path / "tenant")  # written where the tenant can write, built by the tenant
    # The tenant's own user namespace (no seccomp profile): root there, it mounts the decoy over
    # the read-only library (the preload's symlink leads to it), and every program it runs then
    # preloads a file that is called libvgpu.so but intercepts nothing.
    script = f'mount --bind {decoy} /usr/local/vgpu/libvgpu.so && exec "$@"'
    attack = await container.background(["unshare", "-Urm", "sh", "-c", script, "sh",
                                         str(CUPROBE), "init", "ctx", "0", "alloc", str(2 * GIB), *HOLD])
    assert " rc=0" in await attack.wait_for("alloc ")  # past the 1 GiB grant: nothing in-process stopped it
    await attack.wait_for("holding")

    reply = container.inspect()
    [seen] = [p for p in reply.processes if p.library_not_ours]
    assert seen.library_not_ours and seen.library_not_ours.startswith("/usr/local/vgpu/libvgpu.so")
    assert not seen.library_mapped and seen.preload_ours  # the preload file is ours; what it leads to is not
    judgement = container.judge(reply)
    assert judgement.verdict == "degraded"
    assert "library-not-ours" in [r.code for r in judgement.reasons]
    assert blocked_or_detected(container, GIB, "library-not-ours") == "detected"


async def test_a_preload_remounted_from_a_user_namespace_is_not_the_nodes(node: SimNode, tmp_path: Path) -> None:
    container = await node.start(gpu_pod("own-preload"), limit="1g")
    tenant = tmp_path / "tenant"
    tenant.mkdir()
    (tenant / "same").write_text("/usr/local/vgpu/libvgpu.so\n")  # same words, not the node's file
    (tenant / "empty").write_text("")
    same = await container.background(["unshare", "-Urm", "sh", "-c", f'mount --bind {tenant / "same"} /etc/ld.so.preload && exec "$@"', "sh",
                                       str(CUPROBE), "init", "ctx", "0", *HOLD])
    await same.wait_for("holding")
    empty = await container.background(["unshare", "-Urm", "sh", "-c", f'mount --bind {tenant / "empty"} /etc/ld.so.preload && exec "$@"', "sh",
                                        str(CUPROBE), "init", "ctx", "0", "alloc", str(2 * GIB), *HOLD])
    assert " rc=0" in await empty.wait_for("alloc ")  # no library at all in that process
    await empty.wait_for("holding")

    reply = container.inspect()
    assert [p.preload_ours for p in reply.processes].count(False) == 2
    assert blocked_or_detected(container, GIB, "preload-mismatch", "process-without-library") == "detected"


@pytest.mark.parametrize("grant", [True, False], ids=["grant", "env-only"])
async def test_an_entrypoint_that_clears_its_environment_is_still_found_and_judged(node: SimNode, tmp_path: Path, grant: bool) -> None:
    # `exec env -i ...` as the container's entrypoint: no process carries POD_UID or any limit.
    # Only the node's driver stays reachable (the real one needs no environment), and the
    # accounting file is one of its own.
    cleared = ["env", "-i", *(f"{k}={v}" for k, v in node.driver_env.items()),
               f"CUDA_DEVICE_MEMORY_SHARED_CACHE={tmp_path / 'own.cache'}",
               str(CUPROBE), "init", "ctx", "0", "alloc", str(GIB + 512 * MIB), *HOLD]
    container = await node.start(gpu_pod("env-cleared"), cleared, limit="1g", grant=grant)
    line = await container.process.read_line()
    while not line.startswith("alloc "):
        line = await container.process.read_line()
    assert "POD_UID" not in (Path(f"/proc/{container.process.pid}/environ").read_bytes().decode(errors="replace"))

    reply = container.inspect(with_container_id=False)  # the verifier knows only the pod uid and the name
    assert reply.found and container.process.pid in [p.pid for p in reply.processes]
    if grant:  # the library obeys the node's grant, whatever the environment lost
        assert " rc=2" in line, line  # CUDA_ERROR_OUT_OF_MEMORY
        assert blocked_or_detected(container, GIB) == "blocked"
        assert container.judge(reply).verdict == "verified"
    else:  # no grant mount: the limit left with the environment, and the verdict says so
        assert " rc=0" in line, line
        assert blocked_or_detected(container, GIB, "limit-env-missing") == "detected"


TAMPERING = {
    # a process of the container rewrites its (writable) accounting file while another holds memory;
    # each with what the node agent then sees
    "zero-file": ("import os; f = os.open(P, os.O_WRONLY); os.pwrite(f, bytes(os.fstat(f).st_size), 0)", "no longer valid"),
    "zero-counters": ("import os; f = os.open(P, os.O_WRONLY); os.pwrite(f, bytes(os.fstat(f).st_size - 64), 64)", "was overwritten"),
    "zero-totals": ("import os; f = os.open(P, os.O_WRONLY); [os.pwrite(f, bytes(8), 64 + 128 * d + 8) for d in range(16)]", "its processes hold"),
    "truncate": ("import os; os.truncate(P, 0)", "no longer valid"),
    "replace": ("import os, shutil; shutil.copyfile(P, P + '.new'); os.rename(P + '.new', P)", "deleted"),
    "move-aside": ("import os; os.rename(P, P + '.old')", "replaced"),
    "delete": ("import os; os.unlink(P)", "deleted"),
}


@pytest.mark.parametrize("how", sorted(TAMPERING))
async def test_a_tampered_accounting_file_is_blocked_or_reported(node: SimNode, how: str) -> None:
    container = await node.start(gpu_pod(f"tamper-{how}"), limit="1g")
    await container.hold(768 * MIB)
    cache = "/run/kai-isolator/usage.cache"
    code, seen = TAMPERING[how]
    tamper = await container.run(["python3", "-c", f"P = {cache!r}; {code}"])
    assert tamper.returncode == 0, tamper.stderr
    reply = container.inspect()
    assert any(seen in finding for finding in reply.usage_cache_tampered), reply.usage_cache_tampered
    assert "usage-cache-tampered" in [r.code for r in container.judge(reply).reasons]

    # Another process of the container now asks for what the file no longer shows as held.
    second = await container.run([str(CUPROBE), "init", "ctx", "0", "alloc", str(768 * MIB)])
    allocated = " rc=0" in next(line for line in second.stdout.splitlines() if line.startswith("alloc "))
    assert allocated == (blocked_or_detected(container, GIB, "usage-cache-tampered") == "detected")
