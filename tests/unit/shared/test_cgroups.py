"""Kubelet cgroup names: every driver, runtime and QoS class parses back to its pod and container."""

import pytest

from kai_isolator.shared.cgroups import (
    CgroupDriver, ContainerCgroup, QosClass, container_id_from_status, kubelet_cgroup_path, parse_cgroup_path,
    parse_proc_cgroup,
)

UID = "0f3c2a1b-4d5e-4f60-8a9b-0c1d2e3f4a5b"
CID = "ab" * 32


@pytest.mark.parametrize("driver", list(CgroupDriver))
@pytest.mark.parametrize("qos", list(QosClass))
@pytest.mark.parametrize("runtime", ["containerd", "cri-o"])
def test_every_kubelet_name_parses_back(driver, qos, runtime):
    path = "/" + kubelet_cgroup_path(UID, CID, driver=driver, qos=qos, runtime=runtime)
    assert parse_cgroup_path(path) == ContainerCgroup(UID, CID, {"containerd": "containerd" if driver is CgroupDriver.SYSTEMD else "", "cri-o": "cri-o"}[runtime])


def test_known_real_paths():
    assert kubelet_cgroup_path(UID, CID, driver=CgroupDriver.SYSTEMD) == (
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope")
    assert kubelet_cgroup_path(UID, CID, qos=QosClass.GUARANTEED) == f"kubepods/pod{UID}/{CID}"


def test_proc_cgroup_v1_and_v2_and_namespaced_views():
    v1 = f"12:memory:/kubepods/besteffort/pod{UID}/{CID}\n1:name=systemd:/\n"
    v2 = f"0::/../../kubepods-besteffort-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n"
    assert parse_proc_cgroup(v1) == ContainerCgroup(UID, CID, "")
    assert parse_proc_cgroup(v2) == ContainerCgroup(UID, CID, "containerd")


@pytest.mark.parametrize("text", ["0::/\n", "0::/user.slice/session-1.scope\n", f"0::/kubepods/pod{UID}\n",
                                  f"0::/kubepods/pod{UID}/not-a-container\n", "garbage", ""])
def test_non_container_cgroups_are_none(text):
    assert parse_proc_cgroup(text) is None


@pytest.mark.parametrize("below", ["nested", "a/b/c", f"pod{'0' * 8}-0000-0000-0000-{'0' * 12}/{'cd' * 32}"])
def test_a_cgroup_below_a_container_is_that_container(below):
    """What the tenant makes inside its own cgroup, even named like another pod's container, is still its own."""
    for driver in CgroupDriver:
        path = "/" + kubelet_cgroup_path(UID, CID, driver=driver) + "/" + below
        assert parse_cgroup_path(path).container_id == CID and parse_cgroup_path(path).pod_uid == UID


def test_container_id_from_status():
    assert container_id_from_status(f"containerd://{CID}") == CID
    assert container_id_from_status(f"cri-o://{CID}") == CID
