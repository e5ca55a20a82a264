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


# --- a GPU that KAI shares is for its grant holders only (issue 45) -------------------------------------------------

OTHER_UID = "22222222-3333-4444-5555-666666666666"
PLAIN = "d" * 64
SHARED = GPU


def with_others(tmp_path: Path) -> KnownPods:
    plain = {"metadata": {"namespace": "t", "name": "plain-all", "uid": OTHER_UID},
             "status": {"containerStatuses": [{"name": "cuda", "containerID": f"containerd://{PLAIN}"}]}}
    return pods(tmp_path, others=lambda: {OTHER_UID: plain}, shared=lambda: [SHARED])


def test_a_container_of_a_pod_outside_gpu_sharing_is_held_to_nothing_by_name(tmp_path: Path) -> None:
    known = with_others(tmp_path)
    plain = known.target(ContainerCgroup(OTHER_UID, PLAIN))
    assert isinstance(plain, Target) and plain.outside_sharing and plain.limits == {}
    assert (plain.pod.namespace, plain.pod.name, plain.container) == ("t", "plain-all", "cuda")
    assert "grant holders only" in plain.withheld
    unlisted = known.target(ContainerCgroup(OTHER_UID, UNLISTED))  # judged before the kubelet lists it: nothing to grant anyway
    assert isinstance(unlisted, Target) and unlisted.outside_sharing and unlisted.key == (OTHER_UID, f"id-{UNLISTED}")
    assert known.shared_gpus() == {SHARED}
    # The GPU-sharing pod's own containers are judged as before.
    main = known.target(ContainerCgroup(UID, MAIN))
    assert isinstance(main, Target) and not main.outside_sharing and main.limits == {GPU: 1 << 30}


def test_a_pod_the_api_does_not_list_on_the_node_is_left_alone(tmp_path: Path) -> None:
    assert with_others(tmp_path).target(ContainerCgroup("33333333-4444-5555-6666-777777777777", PLAIN)) == "not a pod known on this node"
