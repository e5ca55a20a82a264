"""The enforcer on a GPU that KAI shares (issue 45): a container of a pod outside GPU sharing is held to nothing there,
and judged on no other GPU; a host process outside every kubelet cgroup is reported and left alone. Attribution reads a
/proc laid out as the kernel shows it (stat and cgroup per pid), so nothing but the kubelet's cgroup names the pod."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes_asyncio import client

from kai_isolator.services.nodeagent import grants
from kai_isolator.services.nodeagent.enforce import Enforcer, KnownPods, Target
from kai_isolator.services.devcluster.kai import reservation_pod
from kai_isolator.services.nodeagent.nvml import DriverSnapshot, ProcessMemory
from kai_isolator.shared.cgroups import kubelet_cgroup_path
from kai_isolator.shared.events import Breach

GIB = 1 << 30
SHARED, WHOLE = "GPU-0000fa4e-1111-2222-3333-000000000000", "GPU-0100fa4e-1111-2222-3333-000000000001"
PLAIN_UID, PLAIN_ID = "22222222-3333-4444-5555-666666666666", "d" * 64
PLAIN_POD = {"metadata": {"namespace": "tenant", "name": "plain-all", "uid": PLAIN_UID},
             "status": {"containerStatuses": [{"name": "cuda", "containerID": f"containerd://{PLAIN_ID}"}]}}
PLAIN_PID, HOST_PID = 4100, 4200


def fake_proc(root: Path, pid: int, cgroup: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "stat").write_text(f"{pid} (rawelf) S " + " ".join(["1"] * 18) + " 777 0\n")  # field 22: start time
    (root / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")


def enforcer(tmp_path: Path, shared: list[str]) -> tuple[Enforcer, list[tuple[Target, Breach]]]:
    proc = tmp_path / "proc"
    fake_proc(proc, PLAIN_PID, "/" + kubelet_cgroup_path(PLAIN_UID, PLAIN_ID))
    fake_proc(proc, HOST_PID, "/system.slice/nvidia-persistenced.service")
    reported: list[tuple[Target, Breach]] = []

    async def report(target: Target, breach: Breach) -> None:
        reported.append((target, breach))

    pods = KnownPods(tmp_path / "grants", dict, others=lambda: {PLAIN_UID: PLAIN_POD}, shared=lambda: shared)
    return Enforcer(lambda: SNAPSHOT, pods, report, proc_root=proc, on_breach="warn"), reported


SNAPSHOT = DriverSnapshot(processes=(ProcessMemory(PLAIN_PID, 0, SHARED, 10 * GIB), ProcessMemory(PLAIN_PID, 1, WHOLE, GIB),
                                     ProcessMemory(HOST_PID, 0, SHARED, GIB)),
                          devices=(SHARED, WHOLE), api="compute_v3", taken_at=0.0)


async def test_a_plain_pod_on_a_shared_gpu_is_a_breach_with_a_grant_of_nothing(tmp_path: Path) -> None:
    watching, reported = enforcer(tmp_path, [SHARED])
    poll = await watching.poll()
    [(target, breach)] = reported
    assert (target.pod.name, target.container, breach.device_uuid) == ("plain-all", "cuda", SHARED)
    assert (breach.grant_bytes, breach.tolerance_bytes, breach.measured_bytes) == (0, 0, 10 * GIB)
    # The same container on a whole GPU no reservation pod holds is not judged, nor is the host's daemon anywhere.
    left = {(u.pid, u.device_uuid): u.why for u in poll.unattributed}
    assert left == {(PLAIN_PID, WHOLE): "a pod outside GPU sharing, on a GPU that KAI does not share",
                    (HOST_PID, SHARED): "not in a kubelet container cgroup"}


async def test_without_a_reservation_pod_no_gpu_is_shared_and_nothing_is_judged(tmp_path: Path) -> None:
    watching, reported = enforcer(tmp_path, [])
    poll = await watching.poll()
    assert not reported and not poll.measures and len(poll.unattributed) == 3


# --- what the grant keeper tells the enforcer: the node's other pods and its shared GPUs ---------------------------------


def bound(pod: dict[str, object]) -> dict[str, object]:
    return {**pod, "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "cuda"}]}}


def reservation() -> dict[str, object]:
    """KAI's reservation pod for GPU 0 of the node, as the API server stores it (with its uid)."""
    made = reservation_pod("gpu-node-1", 0)
    made["metadata"]["uid"] = "44444444-5555-6666-7777-888888888888"
    return made


async def keeper(tmp_path: Path) -> grants.GrantKeeper:
    async def publish(event: object) -> None:
        pass

    return grants.GrantKeeper(client.ApiClient(), "gpu-node-1", tmp_path, publish)  # no API call for these pods


async def test_the_keeper_knows_every_other_pod_and_the_gpus_kais_reservation_pods_hold(tmp_path: Path) -> None:
    kept = await keeper(tmp_path)
    try:
        await kept.on_pod(reservation())
        await kept.on_pod(bound(PLAIN_POD))
        assert kept.shared_gpus() == {SHARED}
        assert kept.others == {PLAIN_UID: {"metadata": {"namespace": "tenant", "name": "plain-all", "uid": PLAIN_UID}, "status": {
            "containerStatuses": [{"name": "cuda", "containerID": f"containerd://{PLAIN_ID}"}], "initContainerStatuses": [],
            "ephemeralContainerStatuses": []}}}
        # KAI's reservation pod is never among the others: its own container is never judged.
        assert all(p["metadata"]["namespace"] != "kai-resource-reservation" for p in kept.others.values())
    finally:
        await kept.close()


async def test_a_deleted_pod_is_known_by_its_containers_for_the_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force-deleted, a pod leaves the API while the kubelet still stops its containers: what they hold is still judged."""
    now = [1000.0]
    monkeypatch.setattr(grants.time, "monotonic", lambda: now[0])
    kept = await keeper(tmp_path)
    try:
        await kept.on_pod(reservation())
        await kept.on_pod(bound(PLAIN_POD))
        await kept.on_deleted(bound(PLAIN_POD))
        assert PLAIN_UID in kept.others
        now[0] += grants.DEPARTED_GRACE_S + 1
        await kept.on_deleted(reservation())  # any later event forgets what departed long ago
        assert PLAIN_UID not in kept.others and kept.shared_gpus() == frozenset()
    finally:
        await kept.close()
