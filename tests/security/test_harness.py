"""The simulated container is the one the webhook injects: what a well-behaved tenant sees and gets."""

from __future__ import annotations

from kai_isolator.shared.cgroups import container_of_pid
from security.container import CUPROBE, GIB, LIBRARY_PATH, SimNode, gpu_pod


async def test_an_injected_container_is_limited_verified_and_in_its_kubelet_cgroup(node: SimNode) -> None:
    container = await node.start(gpu_pod("well-behaved"), limit="1g")
    identity = container_of_pid(container.process.pid)
    assert identity is not None and (identity.pod_uid, identity.container_id) == (container.pod_ref.uid, container.container_id)

    preload = await container.run(["cat", "/etc/ld.so.preload"])
    assert preload.stdout.strip() == LIBRARY_PATH
    writable = await container.run(["sh", "-c", f"echo x > {LIBRARY_PATH} || echo refused"])
    assert "refused" in writable.stdout  # the library dir is read-only inside

    result = await container.run([str(CUPROBE), "init", "ctx", "0", "alloc", str(GIB // 2), "alloc", str(GIB), "fake", "0"])
    assert "alloc 536870912 rc=0" in result.stdout and "rc=2" in result.stdout.splitlines()[3], result.stdout
    assert node.driver_stats()["peak"] == GIB // 2  # the driver never saw more than the grant

    assert (container.state_dir / "usage.cache").exists()

    await container.hold(GIB // 4)
    assert node.driver_used() == GIB // 4
    judgement = container.judge()
    assert [r.code for r in judgement.reasons] == container.healthy_codes
    assert judgement.verdict == ("verified" if container.grant_mounted else "degraded")
