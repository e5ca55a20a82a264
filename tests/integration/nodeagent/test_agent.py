"""The node agent on the bus: status in KV and on the stream, install requests, inspect of
real processes (plain and in a private mount namespace), usage gauges and UsageReports."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kai_isolator.services.demo.kubelet import CgroupPlacement, new_container_id
from kai_isolator.services.nodeagent import install
from kai_isolator.services.nodeagent.layout import version_of
from kai_isolator.services.nodeagent.settings import NODE_BUCKET
from kai_isolator.shared.events import (
    InspectReply, InspectRequest, InstallReply, InstallRequest, NodeStatus, PodIsolation, PodRef,
)
from support.bus import RuntimeFactory
from support.nodeagent import MIB, Libraries, namespaced_worker, preloaded_worker
from support.waiting import eventually

UID = "3f2a9c1e-0000-4000-8000-000000000001"
POD = PodRef(namespace="team-a", name="job-0", uid=UID)


def container_env(root: Path, limit: str = "1g", uid: str = UID, cache: str | None = None) -> dict[str, str]:
    state = root / "var/lib/kai-isolator/containers" / f"{uid}_main"
    state.mkdir(parents=True, exist_ok=True)
    return {"POD_UID": uid, "CONTAINER_NAME": "main", "CUDA_DEVICE_MEMORY_LIMIT": limit,
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": cache or str(state / "usage.cache")}


async def test_status_lands_in_kv_and_on_the_stream(start_agent, start_runtime: RuntimeFactory, libraries: Libraries) -> None:
    client = await start_runtime("tester", kv_buckets=[NODE_BUCKET])
    agent = await start_agent("gpu-node-1")
    entry = await client.kv(NODE_BUCKET).get("gpu-node-1")
    status = NodeStatus.model_validate_json(entry.value or b"")
    assert status.active_version == version_of(libraries.v1.read_bytes())
    assert status.ready and status.self_check == "passed" and status.self_check_at is not None
    assert status.gpu_count == 0 and status.problems == []

    (agent.layout.host_root / "dev").mkdir()
    (agent.layout.host_root / "dev" / "nvidia0").touch()
    report = await agent.refresh()
    assert report.gpu_count == 1 and report.sequence > status.sequence
    stored = await client.jetstream.get_last_msg("ISOLATOR", "isolator.node.gpu-node-1.status")
    assert stored.data and b'"gpu_count":1' in stored.data


async def test_install_request_switches_version_and_refuses_unknown_ones(start_agent, start_runtime: RuntimeFactory, libraries: Libraries) -> None:
    client = await start_runtime("tester")
    agent = await start_agent("gpu-node-2")
    v2 = version_of(libraries.v2.read_bytes())

    reply = await client.request(InstallRequest(node_name="gpu-node-2", version=v2), timeout_s=30)
    assert isinstance(reply, InstallReply) and reply.ok and reply.active_version == v2
    assert install.active_version(agent.layout) == v2

    unknown = await client.request(InstallRequest(node_name="gpu-node-2", version="0" * 16), timeout_s=30)
    assert isinstance(unknown, InstallReply) and not unknown.ok and "neither installed nor carried" in unknown.message
    malformed = await client.request(InstallRequest(node_name="gpu-node-2", version="../../etc"), timeout_s=30)
    assert isinstance(malformed, InstallReply) and not malformed.ok and "hex" in malformed.message
    assert install.active_version(agent.layout) == v2


async def test_failing_self_check_is_reported(start_agent, start_runtime: RuntimeFactory) -> None:
    agent = await start_agent("gpu-node-3", self_check_command=["/bin/false"])
    assert agent.last_check is not None and not agent.last_check.passed
    client = await start_runtime("tester", kv_buckets=[NODE_BUCKET])
    status = NodeStatus.model_validate_json((await client.kv(NODE_BUCKET).get("gpu-node-3")).value or b"")
    assert status.self_check == "failed" and not status.ready and "exited 1" in status.message


async def test_inspect_a_host_process(start_agent, start_runtime: RuntimeFactory, libraries: Libraries, kubelet_cgroups: CgroupPlacement) -> None:
    client = await start_runtime("tester")
    agent = await start_agent("gpu-node-4")
    worker = preloaded_worker(agent.layout.link, container_env(agent.layout.host_root))
    container_id = new_container_id()
    kubelet_cgroups.place(worker.pid, UID, container_id)
    try:
        assert worker.alloc(256 * MIB) == 0
        request = InspectRequest(node_name="gpu-node-4", pod=POD, container="main", container_id=f"containerd://{container_id}")
        reply = await client.request(request, timeout_s=30)
    finally:
        worker.stop()
    assert isinstance(reply, InspectReply) and reply.found
    [process] = reply.processes
    assert process.pid == worker.pid and process.library_mapped
    assert process.library_version == version_of(libraries.v1.read_bytes()) == reply.installed_version
    assert process.memory_limit_env == "1g" and process.grant_mounted is False
    assert process.preload == (Path("/etc/ld.so.preload").read_text() if os.path.exists("/etc/ld.so.preload") else None)
    assert process.preload_ours is False  # this machine's /etc/ld.so.preload is not the node agent's file
    assert reply.devices[0].used_bytes == 256 * MIB and reply.devices[0].limit_bytes == 1 << 30


async def test_inspect_a_container_in_its_own_mount_namespace(start_agent, start_runtime: RuntimeFactory, libraries: Libraries, tmp_path: Path,
                                                             kubelet_cgroups: CgroupPlacement) -> None:
    client = await start_runtime("tester")
    agent = await start_agent("gpu-node-5")
    cache_dir = tmp_path / "inside"
    cache_dir.mkdir()
    env = container_env(agent.layout.host_root, limit="512m", cache=str(cache_dir / "usage.cache"))
    container = namespaced_worker(agent.layout.host_root, tmp_path / "ns", env)
    kubelet_cgroups.place(container.pid, UID, new_container_id())
    try:
        assert container.alloc(100 * MIB) == 0
        assert container.alloc(600 * MIB) == 2  # the library enforces the container's limit
        reply = await client.request(InspectRequest(node_name="gpu-node-5", pod=POD, container="main"), timeout_s=30)
    finally:
        container.stop()
    assert isinstance(reply, InspectReply) and reply.found
    process = next(p for p in reply.processes if p.pid == container.pid)
    assert process.preload == "/usr/local/vgpu/libvgpu.so\n"  # its own /etc/ld.so.preload, not this machine's
    assert process.preload_ours  # the node's very file (device and inode), bind-mounted read-only
    assert process.library_mapped and process.library_version == version_of(libraries.v1.read_bytes())
    assert process.memory_limit_env == "512m"
    assert reply.devices[0].used_bytes == 100 * MIB and reply.devices[0].limit_bytes == 512 * MIB


async def test_inspect_of_nothing_and_of_bad_names(start_agent, start_runtime: RuntimeFactory) -> None:
    client = await start_runtime("tester")
    await start_agent("gpu-node-6")
    gone = await client.request(InspectRequest(node_name="gpu-node-6", pod=POD, container="main"), timeout_s=30)
    assert isinstance(gone, InspectReply) and not gone.found and gone.processes == [] and "no running process" in gone.message
    bad = await client.request(InspectRequest(node_name="gpu-node-6", pod=PodRef(namespace="a", name="b", uid="../../etc"), container="main"), timeout_s=30)
    assert isinstance(bad, InspectReply) and not bad.found and "Kubernetes names" in bad.message


async def test_a_tenant_symlink_never_reaches_host_files(start_agent, start_runtime: RuntimeFactory, tmp_path: Path) -> None:
    client = await start_runtime("tester")
    agent = await start_agent("gpu-node-7")
    await client.publish(PodIsolation(pod=POD, resource_version="1", state="running", node_name="gpu-node-7", container="main"))
    await eventually(lambda: UID in agent.pods, timeout_s=30)
    host_file = tmp_path / "host-only.cache"  # a valid cache the tenant must not get reported as its own
    other = preloaded_worker(agent.layout.link, {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(host_file)})
    try:
        assert other.alloc(123 * MIB) == 0
    finally:
        other.stop()
    trap = Path(container_env(agent.layout.host_root)["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    trap.symlink_to(host_file)  # the tenant owns its state dir and plants an absolute link

    assert await agent.report_usage() == []
    reply = await client.request(InspectRequest(node_name="gpu-node-7", pod=POD, container="main"), timeout_s=30)
    assert isinstance(reply, InspectReply) and reply.devices == []


async def test_usage_gauges_and_reports(start_agent, start_runtime: RuntimeFactory) -> None:
    client = await start_runtime("tester")
    agent = await start_agent("gpu-node-8")
    await client.publish(PodIsolation(pod=POD, resource_version="7", state="running", node_name="gpu-node-8", container="main"))
    await eventually(lambda: UID in agent.pods, timeout_s=30)
    worker = preloaded_worker(agent.layout.link, container_env(agent.layout.host_root, limit="2g"))
    try:
        assert worker.alloc(300 * MIB) == 0
        [report] = await agent.report_usage()
    finally:
        worker.stop()
    assert report.pod == POD and report.container == "main" and report.node_name == "gpu-node-8"
    assert report.devices[0].used_bytes == 300 * MIB and report.processes[0].pid == worker.pid
    async with aiohttp.ClientSession() as http, http.get(f"{agent.runtime.probe_url}/metrics") as response:
        text = await response.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    labels = tuple(sorted({"zone": "vGPU", "namespace": "team-a", "pod": "job-0", "container": "main",
                           "vdevice_index": "0", "device_uuid": ""}.items()))
    assert samples[("hami_vgpu_memory_used_bytes", labels)] == 300 * MIB
    assert samples[("hami_vgpu_memory_limit_bytes", labels)] == 2 << 30
    assert samples[("kai_isolator_nodeagent_self_check_passed", ())] == 1
