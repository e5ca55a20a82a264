"""A container's processes are found by the cgroup the kubelet put them in, never by their environment:
one that dropped it (`su -`, `env -i`) is still the container's; one that forges it is not."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from kai_isolator.services.demo.kubelet import CgroupPlacement, cgroup_hierarchies, new_container_id
from kai_isolator.services.nodeagent.layout import HostLayout
from kai_isolator.services.nodeagent.observe import container_pids, inspect_container
from kai_isolator.shared.cgroups import CgroupDriver
from kai_isolator.shared.events import PodRef

POD = PodRef(namespace="team-a", name="train", uid="c1ea0ed0-0000-4000-8000-000000000001")


def test_processes_belong_to_the_container_whose_cgroup_they_are_in(tmp_path: Path, kubelet_cgroups: CgroupPlacement) -> None:
    env = {"PATH": "/usr/bin:/bin", "CUDA_DEVICE_MEMORY_LIMIT": "4147m"}
    marker = tmp_path / "started"
    # The container's main process, and below it a session that started with an empty environment.
    main = subprocess.Popen(["sh", "-c", f"while [ ! -e {marker}.go ]; do sleep 0.01; done; "
                                         f"env -i sh -c 'touch {marker}; exec sleep 30' & exec sleep 30"], env=env)
    forger = subprocess.Popen(["sleep", "30"], env={**env, "POD_UID": POD.uid, "CONTAINER_NAME": "main"})  # not in the cgroup
    try:
        container_id = new_container_id()
        kubelet_cgroups.place(main.pid, POD.uid, container_id)
        Path(f"{marker}.go").touch()
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        view = inspect_container(HostLayout(tmp_path), Path("/proc"), POD, "main", container_id)
        by_mounts, _ = container_pids(Path("/proc"), POD.uid, "main")  # no id: the pod's only container
    finally:
        for process in (main, forger):
            process.kill()
            process.wait()
    limits = {p.pid: p.memory_limit_env for p in view.processes}
    assert view.found and limits[main.pid] == "4147m"
    assert list(limits.values()).count(None) == 1  # the cleared session, reported without its limit
    assert forger.pid not in limits
    assert sorted(by_mounts) == sorted(limits)


def test_another_container_id_or_pod_finds_nothing(tmp_path: Path, kubelet_cgroups: CgroupPlacement) -> None:
    main = subprocess.Popen(["sleep", "30"])
    try:
        kubelet_cgroups.place(main.pid, POD.uid, new_container_id())
        other = inspect_container(HostLayout(tmp_path), Path("/proc"), POD, "main", new_container_id())
        elsewhere = inspect_container(HostLayout(tmp_path), Path("/proc"), PodRef(namespace="x", name="y", uid="0" * 8 + "-0000-4000-8000-" + "0" * 12), "main")
        bad = inspect_container(HostLayout(tmp_path), Path("/proc"), POD, "main", "containerd://not-hex")
    finally:
        main.kill()
        main.wait()
    assert not other.found and not elsewhere.found
    assert not bad.found and "64 hex" in bad.message


@pytest.mark.parametrize("driver", list(CgroupDriver))
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_found_under_either_cgroup_version_and_driver(version: str, driver: CgroupDriver, kubelet_cgroups: CgroupPlacement) -> None:
    chosen = tuple(h for h in cgroup_hierarchies() if (h / "cgroup.controllers").exists() == (version == "v2"))
    if not chosen:
        pytest.skip(f"no writable cgroup {version} hierarchy here")
    placement = CgroupPlacement(prefix=kubelet_cgroups.prefix, driver=driver, hierarchies=chosen)
    main = subprocess.Popen(["sleep", "30"])
    try:
        container_id = new_container_id()
        placement.place(main.pid, POD.uid, container_id)
        found, _ = container_pids(Path("/proc"), POD.uid, "main", container_id)
    finally:
        main.kill()
        main.wait()
        placement.remove()
    assert found == [main.pid]
