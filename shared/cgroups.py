"""Which pod and container a host process belongs to, read from its cgroup as the kubelet names it.

A process cannot change its cgroup from inside an unprivileged container, so this is the
identity the node agent trusts (never `POD_UID` or anything else in the environment).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

# cgroupfs driver: .../pod<uid-with-dashes>/<runtime-prefix?><64 hex>
# systemd driver:  .../kubepods-<qos>-pod<uid_with_underscores>.slice/<runtime>-<64 hex>.scope
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_CONTAINER = re.compile(r"^(?:(cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?$")
_RUNTIME_BY_PREFIX = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker", None: ""}


class CgroupDriver(str, Enum):
    CGROUPFS = "cgroupfs"
    SYSTEMD = "systemd"


class QosClass(str, Enum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BEST_EFFORT = "BestEffort"


@dataclass(frozen=True, slots=True)
class ContainerCgroup:
    """A kubelet-managed container: the pod's uid and the runtime's container id (64 hex)."""

    pod_uid: str
    container_id: str
    runtime: str = ""


def parse_cgroup_path(path: str) -> ContainerCgroup | None:
    """The container a cgroup path names, or None for anything that is not a kubelet container cgroup.

    Paths may be relative to the reader's cgroup namespace (`/../../kubepods/...`). The first pod
    component followed by a container component decides, from the root down: that part is the
    kubelet's, and whatever lies below it (a cgroup the tenant made inside its own, even one named
    like another pod's container) is still that container's.
    """
    parts = [part for part in path.strip().split("/") if part]
    for above, part in zip(parts, parts[1:]):
        pod = _POD.search(above)
        if pod is None:
            continue
        container = _CONTAINER.match(part)
        if container is None:
            return None  # the pod's own cgroup (or a tenant's below it): no container of the kubelet's
        return ContainerCgroup(pod.group(1).replace("_", "-"), container.group(2), _RUNTIME_BY_PREFIX[container.group(1)])
    return None


def parse_proc_cgroup(text: str) -> ContainerCgroup | None:
    """The container of a `/proc/<pid>/cgroup` file (v1 and v2 lines); None when no line names one."""
    for line in text.splitlines():
        _, _, path = line.partition(":")[2].partition(":")
        found = parse_cgroup_path(path)
        if found:
            return found
    return None


def container_of_pid(pid: int, proc: Path = Path("/proc")) -> ContainerCgroup | None:
    """The container host process `pid` runs in; None when it is in none or has exited."""
    try:
        return parse_proc_cgroup((proc / str(pid) / "cgroup").read_text())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def container_id_from_status(container_id: str) -> str:
    """`containerd://<id>` / `cri-o://<id>` / `docker://<id>` from a pod's containerStatuses, as a bare id."""
    return container_id.rpartition("://")[2]


def kubelet_cgroup_path(pod_uid: str, container_id: str, *, driver: CgroupDriver = CgroupDriver.CGROUPFS,
                        qos: QosClass = QosClass.BURSTABLE, runtime: str = "containerd") -> str:
    """The cgroup path the kubelet (and its runtime) gives a container, relative to a hierarchy's root."""
    qos_part = "" if qos is QosClass.GUARANTEED else qos.value.lower()
    if driver is CgroupDriver.CGROUPFS:
        prefix = {"cri-o": "crio-", "docker": "docker-"}.get(runtime, "")
        return "/".join(p for p in ("kubepods", qos_part, f"pod{pod_uid}", f"{prefix}{container_id}") if p)
    pod_slice = "-".join(p for p in ("kubepods", qos_part, f"pod{pod_uid.replace('-', '_')}") if p) + ".slice"
    qos_slice = f"kubepods-{qos_part}.slice" if qos_part else ""
    scope = {"cri-o": "crio", "docker": "docker"}.get(runtime, "cri-containerd") + f"-{container_id}.scope"
    return "/".join(p for p in ("kubepods.slice", qos_slice, pod_slice, scope) if p)
