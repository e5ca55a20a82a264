"""Who the enforcer holds to what (issue 26): every container of a GPU-sharing pod, to what the node granted it."""

from __future__ import annotations

from pathlib import Path

from kai_isolator.services.nodeagent.enforce import KnownPods, Target
from kai_isolator.services.nodeagent.grant_files import write_grant
from kai_isolator.shared.cgroups import ContainerCgroup
from kai_isolator.shared.grant import DeviceGrant, Grant, GrantSource

UID = "0f3c2a1b-4d5e-4f60-8a9b-0c1d2e3f4a5b"
MAIN, SIDECAR, UNLISTED = "a" * 64, "b" * 64, "c" * 64
GPU = "GPU-0000fa4e-1111-2222-3333-000000000000"


def pods(tmp_path: Path, **options: object) -> KnownPods:
    pod = {"metadata": {"namespace": "t", "name": "p", "uid": UID},
           "status": {"containerStatuses": [{"name": "main", "containerID": f"containerd://{MAIN}"},
                                            {"name": "sidecar", "containerID": f"containerd://{SIDECAR}"}]}}
    write_grant(tmp_path, Grant(pod_uid=UID, namespace="t", pod="p", container="main", devices=(DeviceGrant(uuid=GPU, limit_bytes=1 << 30),),
                                source=GrantSource.CONFIGMAP))
    return KnownPods(tmp_path, lambda: {UID: pod}, **options)  # type: ignore[arg-type]


def test_the_target_gets_its_grant_and_a_sidecar_nothing_with_the_reason(tmp_path: Path) -> None:
    known = pods(tmp_path, withheld=lambda uid, name: "devices-invalid: 'all'" if name == "sidecar" else None)
    target = known.target(ContainerCgroup(UID, MAIN))
    assert isinstance(target, Target) and target.limits == {GPU: 1 << 30} and not target.withheld
    sidecar = known.target(ContainerCgroup(UID, SIDECAR))
    assert isinstance(sidecar, Target) and sidecar.limits == {} and sidecar.container == "sidecar"
    assert sidecar.withheld == "no grant was written for container sidecar (devices-invalid: 'all')"


def test_a_container_not_in_the_status_is_held_to_nothing_after_the_grace(tmp_path: Path) -> None:
    assert pods(tmp_path).target(ContainerCgroup(UID, UNLISTED)) == "container id not in the pod's status (yet)"
    unlisted = pods(tmp_path, unlisted_grace_s=0).target(ContainerCgroup(UID, UNLISTED))
    assert isinstance(unlisted, Target) and unlisted.limits == {} and unlisted.container == "" and "not in the pod's status" in unlisted.withheld
    assert unlisted.key == (UID, f"id-{UNLISTED}")


def test_a_pod_that_does_not_share_a_gpu_is_never_held(tmp_path: Path) -> None:
    assert pods(tmp_path).target(ContainerCgroup("11111111-2222-3333-4444-555555555555", MAIN)) == "not a GPU-sharing pod known on this node"
