"""The agent's part in container creation (issue 41, part 2): the decisions its NRI plugin asks for over the
agent's socket. Creation waits, within a bound, for the container's grant, then strips what the tenant set and sets
the grant's values; past the bound, or for a container of the pod that names GPUs and is not KAI's, it refuses with
the reason. At start, on an R615 fake driver, the grant becomes the hard limit of the container's real cgroup v2
leaf, read back through nvmlDeviceGetMemoryLimits_v1, and a program in the leaf asking for more gets
CUDA_ERROR_OUT_OF_MEMORY from the driver; on R580 the node is in library-and-enforcer mode and nothing is set."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu
from kai_isolator.services.nodeagent import creation, grant_files, nvml
from kai_isolator.services.nodeagent.creation import (
    CreationError, CreationGate, CreationReply, CreationRequest, NodeMode, namespace_root, unified_leaf,
)
from kai_isolator.shared.contract import FRACTION_CONTAINER_ANNOTATION
from kai_isolator.shared.grant import DeviceGrant, Grant, GrantSource
from support.cgroups import Programs, make_tree, one, programs_on, rcs, readable_gpu, remove_tree, run, unique_top, v2_mount

HAMI = Path(__file__).resolve().parents[3] / "hami-core"
MIB = 1 << 20
GRANT_MIB = 256
OUT_OF_MEMORY = 2
MOUNT = v2_mount()
needs_leaves = pytest.mark.skipif(os.geteuid() != 0 or MOUNT is None,
                                  reason="makes cgroup v2 leaves and places programs in them (root, a cgroup2 mount)")


def grant_for(uid: str, container: str = "main", uuid: str = "GPU-0", mib: int = GRANT_MIB) -> Grant:
    return Grant(pod_uid=uid, namespace="team-a", pod="p", container=container, devices=(DeviceGrant(uuid=uuid, limit_bytes=mib * MIB),),
                 source=GrantSource.CONFIGMAP)


def ask(container: str = "main", env: list[str] | None = None, event: str = "create", **fields: object) -> CreationRequest:
    return CreationRequest(event=event, pod_uid="uid-1", namespace="team-a", pod="p", container=container,  # type: ignore[arg-type]
                           env=env if env is not None else ["NVIDIA_VISIBLE_DEVICES=GPU-0"], annotations={"gpu-fraction": "0.5"},
                           **fields)  # type: ignore[arg-type]


def decide(gate: CreationGate, request: CreationRequest) -> CreationReply:
    return asyncio.run(gate.decide(request))


def test_a_tenants_own_limits_are_stripped_and_the_grants_set(tmp_path: Path) -> None:
    grant_files.write_grant(tmp_path, grant_for("uid-1"))
    gate = CreationGate(tmp_path, NodeMode.LIBRARY_AND_ENFORCER, hold_s=0)
    env = ["NVIDIA_VISIBLE_DEVICES=GPU-0", "NVIDIA_GPU_MEMORY_LIMIT=15360", "CUDA_DEVICE_MEMORY_LIMIT_0=99g",
           "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=15G", "PATH=/bin"]
    reply = decide(gate, ask(env=env))
    assert reply.allow
    assert reply.remove_env == ["CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "NVIDIA_GPU_MEMORY_LIMIT"]
    # A stripped name the grant has no value for is overwritten empty: NRI forwards no removal of the spec's own.
    assert reply.set_env == {"NVIDIA_GPU_MEMORY_LIMIT": "256", "NVIDIA_GPU_MEMORY_REQUEST": "256",
                             "CUDA_DEVICE_MEMORY_LIMIT": "256m", "CUDA_DEVICE_MEMORY_LIMIT_0": "256m",
                             "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ""}


def test_creation_waits_for_a_grant_written_meanwhile(tmp_path: Path) -> None:
    gate = CreationGate(tmp_path, NodeMode.LIBRARY_AND_ENFORCER, hold_s=30)

    async def scenario() -> CreationReply:
        pending = asyncio.create_task(gate.decide(ask()))
        await asyncio.sleep(creation.POLL_S * 2)  # lets the gate look once and find nothing
        assert not pending.done()
        grant_files.write_grant(tmp_path, grant_for("uid-1"))
        return await pending

    assert asyncio.run(scenario()).set_env["NVIDIA_GPU_MEMORY_LIMIT"] == str(GRANT_MIB)


def test_past_the_bound_creation_is_refused_with_the_reason(tmp_path: Path) -> None:
    reply = decide(CreationGate(tmp_path, NodeMode.LIBRARY_AND_ENFORCER, hold_s=0), ask())
    assert not reply.allow and "no grant yet for team-a/p container main" in reply.reason


def test_a_container_naming_gpus_that_is_not_kais_is_refused_and_one_naming_none_runs(tmp_path: Path) -> None:
    gate = CreationGate(tmp_path, NodeMode.LIBRARY_AND_ENFORCER, hold_s=0)
    annotated = {"gpu-fraction": "0.5", FRACTION_CONTAINER_ANNOTATION: "main"}
    sidecar = ask(container="sidecar").model_copy(update={"annotations": annotated})
    reply = decide(gate, sidecar)
    assert not reply.allow and "names GPUs but is not the pod's GPU-sharing container (main)" in reply.reason
    plain = ask(container="sidecar", env=["PATH=/bin", "CUDA_MPS_PIPE_DIRECTORY=/tmp"]).model_copy(update={"annotations": annotated})
    assert decide(gate, plain) == CreationReply(allow=True, remove_env=["CUDA_MPS_PIPE_DIRECTORY"],
                                                set_env={"CUDA_MPS_PIPE_DIRECTORY": ""})


def test_the_socket_speaks_one_json_line_each_way_and_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    grant_files.write_grant(tmp_path / "grants", grant_for("uid-1"))
    gate = CreationGate(tmp_path / "grants", NodeMode.LIBRARY_AND_ENFORCER, hold_s=0)
    path = tmp_path / "run" / "nri.sock"

    async def exchange(line: bytes) -> dict[str, object]:
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(line)
        await writer.drain()
        answer = json.loads(await reader.readline())
        writer.close()
        return answer

    async def scenario() -> tuple[dict[str, object], dict[str, object], int]:
        server = await creation.serve(gate, path)
        try:
            good = await exchange(ask().model_dump_json().encode() + b"\n")
            bad = await exchange(b'{"event": "delete"}\n')
        finally:
            server.close()
            await server.wait_closed()
        return good, bad, path.stat().st_mode & 0o777 if path.exists() else 0o600

    good, bad, mode = asyncio.run(scenario())
    assert good["allow"] is True and good["set_env"]["CUDA_DEVICE_MEMORY_LIMIT"] == "256m"  # type: ignore[index]
    assert bad == {"allow": False, "reason": "unreadable request: ValidationError", "remove_env": [], "set_env": {}}
    assert mode == 0o600


# --- the driver's cap (fake R615 / R580 driver, real cgroup v2 leaves) ------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def leaf() -> Iterator[Path]:
    assert MOUNT is not None
    top = make_tree(unique_top(MOUNT), "pod/ctr")
    try:
        yield top / "pod" / "ctr"
    finally:
        remove_tree(top)


def gpu_of(branch: int) -> Iterator[FakeGpu]:
    with readable_gpu(total_mib=1024, driver_branch=branch) as started:
        yield started


@pytest.fixture
def gpu615() -> Iterator[FakeGpu]:
    yield from gpu_of(615)


@pytest.fixture
def gpu580() -> Iterator[FakeGpu]:
    yield from gpu_of(580)


@needs_leaves
def test_on_r615_the_grant_is_the_leafs_hard_limit_and_the_driver_refuses_past_it(gpu615: FakeGpu, leaf: Path, tmp_path: Path) -> None:
    driver = nvml.Nvml(str(gpu615.nvml))
    [(_, uuid)] = driver.devices()
    gate = CreationGate(tmp_path, creation.detect_mode(driver, MOUNT), driver=driver, mount=MOUNT)
    assert gate.mode is NodeMode.DRIVER_CAPPED
    grant_files.write_grant(tmp_path, grant_for("uid-1", uuid=uuid))
    programs: Iterator[Programs] = programs_on(gpu615)
    started = next(programs)
    try:
        init = started.start("wait", cgroup=leaf)  # the container's init, parked in its leaf as runc parks it
        assert init.said() == []  # it has joined the leaf and waits
        capped: dict[str, int] = {}
        gate.on_capped = lambda _request, read_back: capped.update(read_back)
        assert decide(gate, ask(event="start", pid=init.pid)) == CreationReply(allow=True)
        assert capped == {uuid: GRANT_MIB * MIB}
        held = nvml.get_memory_limit(driver, uuid, str(leaf))
        assert held is not None and (held.soft_bytes, held.hard_bytes) == (GRANT_MIB * MIB, GRANT_MIB * MIB)
        # What inspect answers the verifier: the cap read back on the leaf of any of the container's processes.
        assert gate.caps_held("uid-1", "main", init.pid) == {uuid: GRANT_MIB * MIB}
        asked = run(gpu615, "init", "alloc", 512 * MIB, "cuinfo", cgroup=leaf)
        assert rcs(asked, "alloc") == [OUT_OF_MEMORY]
        assert one(asked, "cuinfo")["total"] == GRANT_MIB * MIB
    finally:
        started.stop()
        driver.close()


@needs_leaves
def test_on_r615_a_gpu_container_without_a_grant_is_capped_at_zero(gpu615: FakeGpu, leaf: Path, tmp_path: Path) -> None:
    driver = nvml.Nvml(str(gpu615.nvml))
    [(_, uuid)] = driver.devices()
    gate = CreationGate(tmp_path, NodeMode.DRIVER_CAPPED, driver=driver, mount=MOUNT)
    programs = programs_on(gpu615)
    started = next(programs)
    try:
        init = started.start("wait", cgroup=leaf)
        assert init.said() == []
        assert decide(gate, ask(container="sidecar", event="start", pid=init.pid)).allow
        held = nvml.get_memory_limit(driver, uuid, str(leaf))
        assert held is not None and held.hard_bytes == 0
        assert rcs(run(gpu615, "init", "ctx", cgroup=leaf), "ctx") == [OUT_OF_MEMORY]  # not even a context fits
    finally:
        started.stop()
        driver.close()


@needs_leaves
def test_a_start_whose_init_has_no_leaf_is_refused_on_a_capped_node(gpu615: FakeGpu, tmp_path: Path) -> None:
    driver = nvml.Nvml(str(gpu615.nvml))
    grant_files.write_grant(tmp_path, grant_for("uid-1"))
    gate = CreationGate(tmp_path, NodeMode.DRIVER_CAPPED, driver=driver, mount=MOUNT, proc_root=tmp_path / "no-proc")
    try:
        reply = decide(gate, ask(event="start", pid=4242))
        assert not reply.allow and "cannot read the cgroups of the container's init 4242" in reply.reason
    finally:
        driver.close()


@needs_leaves
def test_on_r580_the_node_is_library_and_enforcer_and_start_sets_nothing(gpu580: FakeGpu, tmp_path: Path) -> None:
    driver = nvml.Nvml(str(gpu580.nvml))
    try:
        gate = CreationGate(tmp_path, creation.detect_mode(driver, MOUNT), driver=driver, mount=MOUNT)
        assert gate.mode is NodeMode.LIBRARY_AND_ENFORCER
        assert decide(gate, ask(event="start", pid=os.getpid())) == CreationReply(allow=True)
        grant_files.write_grant(tmp_path, grant_for("uid-1"))
        assert gate.caps_held("uid-1", "main", os.getpid()) == {}  # nothing to read back: the library and the enforcer hold
    finally:
        driver.close()
    assert creation.detect_mode(None, MOUNT) is NodeMode.LIBRARY_AND_ENFORCER


# --- the agent in a cgroup namespace of its own (containerd gives a container one on a cgroup v2 host) ---------------

AGENT_PID, TENANT_PID = 4242, 5151
AGENT_CGROUP = "kubepods/burstable/pod-agent/ctr-agent"
TENANT_CGROUP = "kubepods/besteffort/pod-tenant/ctr-tenant"


def hierarchy(tmp_path: Path, agent_sees: str, tenant_sees: str) -> tuple[Path, Path]:
    """A cgroup v2 tree (each cgroup's `cgroup.procs`, as the kernel lists its processes) and a /proc whose
    `<pid>/cgroup` says what the kernel shows the agent: paths relative to the agent's namespace."""
    mount, proc = tmp_path / "cgroup", tmp_path / "proc"
    for cgroup, pid in (("", None), (AGENT_CGROUP, AGENT_PID), (TENANT_CGROUP, TENANT_PID)):
        (mount / cgroup).mkdir(parents=True, exist_ok=True)
        (mount / cgroup / "cgroup.procs").write_text(f"{pid}\n" if pid else "")
    for pid, seen in ((AGENT_PID, agent_sees), (TENANT_PID, tenant_sees)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::{seen}\n")
    return mount, proc


def test_in_a_cgroup_namespace_of_its_own_the_agent_finds_the_tenants_leaf(tmp_path: Path) -> None:
    mount, proc = hierarchy(tmp_path, "/", "/../../../besteffort/pod-tenant/ctr-tenant")
    namespace = namespace_root(mount, proc, AGENT_PID)
    assert namespace == f"/{AGENT_CGROUP}"
    assert unified_leaf(proc, TENANT_PID, mount, namespace) == mount / TENANT_CGROUP


def test_without_a_namespace_of_its_own_paths_are_the_hierarchys(tmp_path: Path) -> None:
    mount, proc = hierarchy(tmp_path, f"/{AGENT_CGROUP}", f"/{TENANT_CGROUP}")
    assert namespace_root(mount, proc, AGENT_PID) == "/"
    assert unified_leaf(proc, TENANT_PID, mount) == mount / TENANT_CGROUP


def test_an_agent_in_no_cgroup_of_the_mount_cannot_place_its_namespace(tmp_path: Path) -> None:
    mount, proc = hierarchy(tmp_path, "/", "/../x")
    (mount / AGENT_CGROUP / "cgroup.procs").write_text("")  # the mount is another hierarchy than the agent's
    with pytest.raises(CreationError, match="its namespace cannot be placed"):
        namespace_root(mount, proc, AGENT_PID)


@needs_leaves
def test_the_whole_hierarchy_is_found_by_its_root_cgroup_as_by_its_mount_root() -> None:
    """The agent knows the whole hierarchy by its root cgroup (no cgroup.type, which every other has); the test support
    by the mount's root in mountinfo ("/"): outside a cgroup namespace, as here, both name the same mount."""
    assert creation.v2_mount() == MOUNT
