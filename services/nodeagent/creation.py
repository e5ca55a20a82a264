"""The agent's part in container creation (NRI): the decisions its plugin (`nri/`, a thin Go adapter over
containerd's NRI library) asks for, one JSON line per question on the agent's unix socket.

- `create` (NRI CreateContainer, before the OCI spec goes to the runtime): hold until the container's grant exists,
  at most `hold_s` (under containerd's plugin request timeout, past which NRI would drop the plugin); past it
  refuse, with the reason the kubelet shows, and the kubelet retries. Strip every `NVIDIA_GPU_MEMORY_*`,
  `CUDA_DEVICE_MEMORY_*` and `CUDA_MPS_*` the tenant set, and set the grant's values; a stripped name the grant has
  no value for is set empty (see `blanked`: NRI forwards a removal to the OCI spec only for what a plugin added).
- `start` (NRI StartContainer): runc has made the container's cgroups (on a hybrid host it joins the unified
  hierarchy too) and parked its init at the exec fifo, so the leaf exists and no tenant code has run. On a node
  whose driver holds per-cgroup limits the grant is set as the leaf's hard limit and read back; a failure refuses
  the start. A container of the pod that names GPUs but holds no grant is capped at 0.

Which mode the node is in is decided once, from the driver and the kernel: `driver-capped` where NVML answers the
limits API on a cgroup v2 leaf, else `library-and-enforcer` (today's path). The enforcer stays on in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kai_isolator.shared.contract import FRACTION_CONTAINER_ANNOTATION, LIMIT_ENV
from kai_isolator.shared.errors import IsolatorError
from kai_isolator.shared.grant import Grant

from . import grant_files, nvml

log = logging.getLogger(__name__)
MIB = 1 << 20
TENANT_PREFIXES = ("NVIDIA_GPU_MEMORY_", "CUDA_DEVICE_MEMORY_", "CUDA_MPS_")
DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
NO_GPUS = ("", "void", "none")
POLL_S = 0.05  # how often a held creation looks for its grant file again
MAX_LINE = 1 << 20


class NodeMode(str, Enum):
    DRIVER_CAPPED = "driver-capped"  # R615+, cgroup v2, not MIG: the driver refuses past the grant
    LIBRARY_AND_ENFORCER = "library-and-enforcer"  # libvgpu.so and the enforcer hold the grant


class CreationError(IsolatorError):
    """A container must not be created or started as asked; the message is what `kubectl describe pod` shows."""


class CreationRequest(BaseModel):
    """One question from the NRI plugin (its Go `request`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    event: Literal["create", "start"]
    pod_uid: str = Field(min_length=1)
    namespace: str
    pod: str
    container: str = Field(min_length=1)
    env: list[str] | None = None
    cgroups_path: str = ""
    pid: int = Field(0, ge=0)
    annotations: dict[str, str] | None = None


class CreationReply(BaseModel):
    """The answer (its Go `reply`): a refusal carries the reason; an allowance the environment to strip and set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: bool
    reason: str = ""
    remove_env: list[str] = Field(default_factory=list)
    set_env: dict[str, str] = Field(default_factory=dict)


def env_map(env: list[str] | None) -> dict[str, str]:
    """The container's environment as the process will see it: the last of a repeated name wins."""
    return dict(item.split("=", 1) if "=" in item else (item, "") for item in env or [])


def names_gpus(env: dict[str, str]) -> bool:
    return env.get(DEVICES_ENV, "").strip().lower() not in NO_GPUS


def grant_env(grant: Grant) -> dict[str, str]:
    """The grant's values, in each reader's spelling: NVIDIA's toolkit hook (whole MiB, one device), HAMi's
    library (per device index, MiB with its `m`)."""
    values: dict[str, str] = {}
    mib = [device.limit_bytes // MIB for device in grant.devices]
    values["NVIDIA_GPU_MEMORY_LIMIT"] = str(min(mib))
    values["NVIDIA_GPU_MEMORY_REQUEST"] = str(min(mib))
    values[LIMIT_ENV] = f"{mib[0]}m"
    for index, limit in enumerate(mib):
        values[f"{LIMIT_ENV}_{index}"] = f"{limit}m"
    return values


def tenant_names(env: dict[str, str]) -> list[str]:
    return sorted(name for name in env if name.startswith(TENANT_PREFIXES))


def blanked(strip: list[str], values: dict[str, str]) -> dict[str, str]:
    """The values to set: the grant's, and an empty value for every stripped name the grant does not set.

    NRI's runtime side (v0.12.3, vendored by containerd 2.4.2; v0.12.5 alike) merges a plugin's `RemoveEnv` into
    the request later plugins see and into earlier plugins' additions, but forwards only additions to the adjustment
    the runtime applies to the OCI spec: a removal of a variable from the pod spec or the image is dropped, while an
    addition replaces the variable in place. So a tenant's value is overwritten, never merely asked away.
    """
    return {**{name: "" for name in strip}, **values}


def cgroup_path(proc_root: Path, pid: int, who: str = "process") -> str:
    """`pid`'s cgroup v2 path (`0::` of /proc/<pid>/cgroup), as the kernel shows it to this process: relative to this
    process's cgroup namespace, so it starts with `/..` for a cgroup outside it."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError as error:
        raise CreationError(f"cannot read the cgroups of {who} {pid}: {error}") from None
    inside = next((line[3:] for line in text.splitlines() if line.startswith("0::")), None)
    if not inside:
        raise CreationError(f"{who} {pid} is in no cgroup v2 leaf: the driver's cap needs one")
    return inside


def namespace_root(mount: Path, proc_root: Path = Path("/proc"), pid: int | None = None) -> str:
    """Where this process's cgroup namespace is rooted in the whole hierarchy mounted at `mount` ("/" without a namespace
    of its own). containerd gives a container one on a cgroup v2 host, so the agent reads every other process's cgroup
    relative to its own: its own cgroup, found by the kernel's list of its processes, says where that is."""
    pid = os.getpid() if pid is None else pid
    own = cgroup_path(proc_root, pid)
    if _lists(mount / own.lstrip("/") / "cgroup.procs", pid):
        return "/"  # the path the kernel shows is the whole hierarchy's: no namespace of its own
    for directory, _, files in os.walk(mount):
        if "cgroup.procs" in files and _lists(Path(directory) / "cgroup.procs", pid):
            below = Path(directory).relative_to(mount)
            absolute = "/" if below == Path(".") else f"/{below}"
            if own == "/":
                return posixpath.normpath(absolute)
            if absolute.endswith(own):
                return posixpath.normpath(absolute[: -len(own)] or "/")
    raise CreationError(f"this process ({pid}) is in no cgroup of the hierarchy at {mount}: its namespace cannot be placed")


def _lists(procs: Path, pid: int) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return pid in {int(line) for line in procs.read_text().split()}
    return False


def unified_leaf(proc_root: Path, pid: int, mount: Path, namespace: str = "/") -> Path:
    """The container's cgroup v2 leaf as the kernel names it for its init, under the v2 mount the agent sees, where
    the agent's own cgroup namespace is rooted at `namespace` (namespace_root); what NVIDIA's toolkit hook does."""
    inside = cgroup_path(proc_root, pid, "the container's init")
    absolute = posixpath.normpath(posixpath.join(namespace, inside.lstrip("/")))
    if absolute == "/":
        raise CreationError(f"the container's init {pid} is in no cgroup v2 leaf: the driver's cap needs one")
    leaf = mount / absolute.lstrip("/")
    if not leaf.is_dir():
        raise CreationError(f"the container's leaf {leaf} does not exist where the agent looks")
    return leaf


def v2_mount() -> Path | None:
    """Where this process sees the whole cgroup v2 hierarchy mounted (/sys/fs/cgroup/unified beside v1). A mount of
    one cgroup below the root (a container's own view in a cgroup namespace) is not the whole: only the root cgroup
    lacks `cgroup.type`."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            point = Path(fields[4])
            if fields[fields.index("-") + 1] == "cgroup2" and not (point / "cgroup.type").exists() and (point / "cgroup.procs").exists():
                return point
    return None


def detect_mode(driver: nvml.Nvml | None, mount: Path | None) -> NodeMode:
    """driver-capped only where every device answers the limits API on the v2 hierarchy (MIG handles and pre-615
    drivers answer NOT_SUPPORTED or lack the entry point)."""
    if driver is None or mount is None:
        return NodeMode.LIBRARY_AND_ENFORCER
    try:
        devices = driver.devices()
        if devices and all(nvml.can_limit_memory(driver, uuid, str(mount)) for _, uuid in devices):
            return NodeMode.DRIVER_CAPPED
    except nvml.NvmlError as error:
        log.warning("cannot ask the driver for per-cgroup limits; the library and the enforcer hold", extra={"error": str(error)})
    return NodeMode.LIBRARY_AND_ENFORCER


@dataclass
class CreationGate:
    """The decisions. `grant_root` is the host's grant dir as the agent sees it; `driver` the agent's NVML."""

    grant_root: Path
    mode: NodeMode
    driver: nvml.Nvml | None = None
    mount: Path | None = None
    proc_root: Path = Path("/proc")
    namespace: str = "/"  # where the agent's cgroup namespace is rooted in the hierarchy (namespace_root)
    hold_s: float = 1.5
    on_capped: Callable[[CreationRequest, dict[str, int]], None] | None = None  # uuid -> hard limit read back

    async def decide(self, request: CreationRequest) -> CreationReply:
        try:
            if request.event == "create":
                return await self._create(request)
            return await asyncio.to_thread(self._start, request)
        except CreationError as error:
            log.warning("container held back", extra={"pod_uid": request.pod_uid, "container": request.container, "reason": str(error)})
            return CreationReply(allow=False, reason=str(error))

    def _is_target(self, request: CreationRequest) -> bool | None:
        """Whether KAI names this container the fraction container; None when the pod does not say (then the
        grant's existence decides)."""
        named = (request.annotations or {}).get(FRACTION_CONTAINER_ANNOTATION)
        return None if not named else named == request.container

    async def _wait_for_grant(self, request: CreationRequest) -> Grant | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s
        while True:
            grant = grant_files.read_grant(self.grant_root, request.pod_uid, request.container)
            if grant is not None or loop.time() >= deadline:
                return grant
            await asyncio.sleep(POLL_S)  # the grant file is written by the agent's keeper; no event to wait on here

    async def _create(self, request: CreationRequest) -> CreationReply:
        env = env_map(request.env)
        strip = tenant_names(env)
        target = self._is_target(request)
        if target is False:
            if names_gpus(env):
                raise CreationError(f"container {request.container} names GPUs but is not the pod's GPU-sharing container "
                                    f"({(request.annotations or {})[FRACTION_CONTAINER_ANNOTATION]})")
            return CreationReply(allow=True, remove_env=strip, set_env=blanked(strip, {}))
        if not names_gpus(env) and target is None:
            # No driver is mounted into it: nothing to hold.
            return CreationReply(allow=True, remove_env=strip, set_env=blanked(strip, {}))
        grant = await self._wait_for_grant(request)
        if grant is None:
            raise CreationError(f"no grant yet for {request.namespace}/{request.pod} container {request.container} "
                                f"after {self.hold_s:.1f}s; creation retried")
        return CreationReply(allow=True, remove_env=strip, set_env=blanked(strip, grant_env(grant)))

    def _start(self, request: CreationRequest) -> CreationReply:
        if self.mode is not NodeMode.DRIVER_CAPPED:
            return CreationReply(allow=True)
        env = env_map(request.env)
        grant = grant_files.read_grant(self.grant_root, request.pod_uid, request.container)
        if grant is None and not names_gpus(env):
            return CreationReply(allow=True)
        assert self.driver is not None and self.mount is not None
        if request.pid <= 0:
            raise CreationError("the runtime gave no pid for the container's init: its leaf cannot be capped")
        leaf = str(unified_leaf(self.proc_root, request.pid, self.mount, self.namespace))
        # A container naming GPUs without a grant is capped at 0 on every device: it may not allocate at all.
        caps = ({d.uuid: d.limit_bytes for d in grant.devices} if grant is not None
                else {uuid: 0 for _, uuid in self.driver.devices()})
        read_back = {uuid: self._cap(uuid, leaf, hard) for uuid, hard in caps.items()}
        if self.on_capped is not None:
            self.on_capped(request, read_back)
        return CreationReply(allow=True)

    def caps_held(self, pod_uid: str, container: str, pid: int) -> dict[str, int]:
        """The hard limit the driver holds on the leaf of the container's process `pid`, per device of its grant,
        read back through nvmlDeviceGetMemoryLimits_v1; empty where the node is not driver-capped, the container has
        no grant, or the driver holds nothing for its leaf (the verifier then names it library-and-enforcer)."""
        if self.mode is not NodeMode.DRIVER_CAPPED or self.driver is None or self.mount is None:
            return {}
        grant = grant_files.read_grant(self.grant_root, pod_uid, container)
        if grant is None:
            return {}
        try:
            leaf = str(unified_leaf(self.proc_root, pid, self.mount, self.namespace))
            held = {d.uuid: nvml.get_memory_limit(self.driver, d.uuid, leaf) for d in grant.devices}
        except (CreationError, nvml.NvmlError) as error:
            log.warning("cannot read the driver's cap back", extra={"pod_uid": pod_uid, "container": container, "error": str(error)})
            return {}
        return {uuid: limits.hard_bytes for uuid, limits in held.items() if limits is not None}

    def _cap(self, uuid: str, leaf: str, hard: int) -> int:
        try:
            nvml.set_memory_limit(self.driver, uuid, leaf, hard)  # type: ignore[arg-type]
            held = nvml.get_memory_limit(self.driver, uuid, leaf)  # type: ignore[arg-type]
        except nvml.NvmlError as error:
            raise CreationError(f"the driver refused the cap of {hard // MIB} MiB on {leaf}: {error}") from None
        if held is None or held.hard_bytes != hard:
            raise CreationError(f"the driver holds {held} for {leaf} on {uuid}, not the grant's {hard} bytes")
        return held.hard_bytes


async def serve(gate: CreationGate, path: Path) -> asyncio.AbstractServer:
    """The decision socket: one JSON request line in, one reply line out, per connection. Root only (0600): the
    plugin runs as root beside containerd."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            try:
                reply = await gate.decide(CreationRequest.model_validate_json(line))
            except (ValidationError, ValueError) as error:
                reply = CreationReply(allow=False, reason=f"unreadable request: {error.__class__.__name__}")
            writer.write(reply.model_dump_json().encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_unix_server(answer, path=str(path), limit=MAX_LINE)
    os.chmod(path, 0o600)
    return server

