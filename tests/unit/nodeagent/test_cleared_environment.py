"""A container process that dropped its environment (`su -`, `env -i`) is still found and reported."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from kai_isolator.services.nodeagent.layout import HostLayout
from kai_isolator.services.nodeagent.observe import inspect_container
from kai_isolator.shared.events import PodRef

POD = PodRef(namespace="team-a", name="train", uid="c1eared-0001")


def test_descendants_with_a_cleared_environment_belong_to_the_container(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "POD_UID": POD.uid, "CONTAINER_NAME": "main", "CUDA_DEVICE_MEMORY_LIMIT": "4147m"}
    marker = tmp_path / "started"
    # The container's main process, and below it a session that started with an empty environment.
    main = subprocess.Popen(["sh", "-c", f"env -i sh -c 'touch {marker}; exec sleep 30' & exec sleep 30"], env=env)
    bystander = subprocess.Popen(["env", "-i", "sleep", "30"])  # not the container's: not its descendant
    try:
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        view = inspect_container(HostLayout(tmp_path), Path("/proc"), POD, "main")
    finally:
        for process in (main, bystander):
            process.kill()
            process.wait()
    limits = {p.pid: p.memory_limit_env for p in view.processes}
    assert view.found and limits[main.pid] == "4147m"
    assert list(limits.values()).count(None) == 1  # the cleared session, reported without its limit
    assert bystander.pid not in limits
