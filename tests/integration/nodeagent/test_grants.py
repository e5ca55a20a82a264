"""Grants on a (sandbox) API server: the node agent watches the pods bound to its node, writes each GPU-sharing
container's grant once KAI's ConfigMap exists, publishes why on the bus, survives restarts and 410s, and removes
the grant with the pod."""

from __future__ import annotations

import asyncio
import contextlib
import json
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from kubernetes_asyncio import client, config

from kai_isolator.services.nodeagent.grants import GrantKeeper, grant_path, read_grant
from kai_isolator.services.sandbox.api import SandboxApi
from kai_isolator.services.sandbox.nodesim import fake_gpu_uuid
from kai_isolator.services.sandbox.settings import SandboxSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.events import GrantDecision, decode
from kai_isolator.shared.grant import GrantSource
from kai_isolator.shared.settings import BusSettings

NODE = "gpu-node-1"
MIB = 1 << 20


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[SandboxApi]:
    settings = SandboxSettings(kubeconfig=tmp_path / "kubeconfig", bookmark_interval_s=0.1, node_step_s=0.02,
                               gpu_nodes=(f"{NODE}:15360", "gpu-node-2:15360"))
    async with SandboxApi(settings) as api:
        yield api


@pytest.fixture
async def api(sandbox: SandboxApi) -> AsyncIterator[client.ApiClient]:
    api_client = await config.new_client_from_config(config_file=str(sandbox.settings.kubeconfig))
    async with api_client:
        yield api_client


class Keepers:
    """GrantKeepers on one host's grant dir, started and stopped like agent restarts; decisions collected."""

    def __init__(self, api: client.ApiClient, root: Path) -> None:
        self.api = api
        self.root = root
        self.decisions: list[GrantDecision] = []
        self.task: asyncio.Task[None] | None = None
        self.keeper: GrantKeeper | None = None

    async def publish(self, event: GrantDecision) -> None:
        self.decisions.append(event)

    async def start(self, node: str = NODE) -> GrantKeeper:
        self.keeper = GrantKeeper(self.api, node, self.root, self.publish, retry_s=0.05, stale_grace_s=0)
        self.task = asyncio.create_task(self.keeper.run())
        await asyncio.wait_for(self.keeper.synced.wait(), 10)
        return self.keeper

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def decision(self, match: Callable[[GrantDecision], bool], timeout_s: float = 10) -> GrantDecision:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = next((d for d in self.decisions if match(d)), None)
            if found is not None:
                return found
            await asyncio.sleep(0.02)
        raise AssertionError(f"no such decision in {self.decisions}")


@pytest.fixture
async def keepers(api: client.ApiClient, tmp_path: Path) -> AsyncIterator[Keepers]:
    made = Keepers(api, tmp_path / "host" / "var/lib/kai-isolator/grants")
    yield made
    await made.stop()


def gpu_pod(name: str, *, node: str | None = None, selector: str | None = NODE, configmap: str | None = None, **annotations: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "x"}]}
    if node:
        spec["nodeName"] = node
    elif selector:
        spec["nodeSelector"] = {"kubernetes.io/hostname": selector}
    meta_annotations = {"gpu-memory": "4096", **annotations}
    if configmap:
        meta_annotations["runai/shared-gpu-configmap"] = configmap  # the ConfigMap name KAI's admission uses
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": meta_annotations}, "spec": spec}


async def wait_for_file(path: Path, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.02)


async def test_a_bound_pod_gets_its_grant_from_kais_configmap_and_loses_it_when_deleted(sandbox: SandboxApi, keepers: Keepers) -> None:
    await keepers.start()
    pod = await sandbox.create("pods", gpu_pod("train"), "default")
    uid = pod["metadata"]["uid"]
    path = grant_path(keepers.root, uid, "main")
    await wait_for_file(path)
    grant = read_grant(keepers.root, uid, "main")
    assert grant is not None and (grant.namespace, grant.pod, grant.container) == ("default", "train", "main")
    assert [(d.uuid, d.limit_bytes) for d in grant.devices] == [(fake_gpu_uuid(0), 4147 * MIB)] and grant.source is GrantSource.CONFIGMAP
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    written = await keepers.decision(lambda d: d.outcome == "written")
    assert (written.pod.uid, written.limit_bytes, written.devices, written.reasons) == (uid, 4147 * MIB, [fake_gpu_uuid(0)], [])
    sandbox.delete("pods", "default", "train")
    await keepers.decision(lambda d: d.outcome == "removed" and d.container == "main")
    assert not path.parent.exists()


async def test_pods_of_other_nodes_and_pods_not_sharing_a_gpu_get_nothing(sandbox: SandboxApi, keepers: Keepers) -> None:
    await keepers.start()
    await sandbox.create("pods", gpu_pod("elsewhere", selector="gpu-node-2"), "default")
    plain = gpu_pod("plain")
    plain["metadata"]["annotations"] = {}
    await sandbox.create("pods", plain, "default")
    await sandbox.create("pods", gpu_pod("here"), "default")
    await keepers.decision(lambda d: d.pod.name == "here" and d.outcome == "written")
    assert {d.pod.name for d in keepers.decisions} == {"here"}
    assert len(list(keepers.root.iterdir())) == 1


async def test_a_missing_configmap_is_waited_for_and_a_tenant_raised_limit_loses(sandbox: SandboxApi, keepers: Keepers) -> None:
    await keepers.start()
    pod = await sandbox.create("pods", gpu_pod("early", node=NODE, configmap="early-cm"), "default")  # bound, no binder ran
    uid = pod["metadata"]["uid"]
    withheld = await keepers.decision(lambda d: d.outcome == "withheld")
    assert [r.code for r in withheld.reasons] == ["configmap-missing"] and "early-cm-0" in withheld.reasons[0].message
    assert not grant_path(keepers.root, uid, "main").exists()
    await asyncio.sleep(0.3)  # several retries: the same fact is published once
    assert len([d for d in keepers.decisions if d.outcome == "withheld"]) == 1
    # The tenant writes the ConfigMap itself, with the whole card.
    await sandbox.create("configmaps", {"metadata": {"name": "early-cm-0"},
                                        "data": {"CUDA_DEVICE_MEMORY_LIMIT": "15g", "NVIDIA_VISIBLE_DEVICES": fake_gpu_uuid(0)}}, "default")
    written = await keepers.decision(lambda d: d.outcome == "written")
    assert written.source == "annotation" and written.limit_bytes == 4147 * MIB and written.configmap_limit_bytes == 15 << 30
    assert [r.code for r in written.reasons] == ["limit-disagrees"]
    grant = read_grant(keepers.root, uid, "main")
    assert grant is not None and grant.devices[0].limit_bytes == 4147 * MIB and "smaller is granted" in grant.reason


async def test_bad_inputs_withhold_the_grant_with_a_reason(sandbox: SandboxApi, keepers: Keepers) -> None:
    await keepers.start()
    await sandbox.create("configmaps", {"metadata": {"name": "bad-cm-0"}, "data": {"CUDA_DEVICE_MEMORY_LIMIT": "4147m", "NVIDIA_VISIBLE_DEVICES": "all"}}, "default")
    pod = await sandbox.create("pods", gpu_pod("bad", node=NODE, configmap="bad-cm"), "default")
    withheld = await keepers.decision(lambda d: d.outcome == "withheld")
    assert [r.code for r in withheld.reasons] == ["devices-invalid"] and "'all'" in withheld.reasons[0].message
    assert not grant_path(keepers.root, pod["metadata"]["uid"], "main").parent.exists()


async def test_a_written_grant_survives_a_deleted_configmap_and_is_never_raised(sandbox: SandboxApi, keepers: Keepers) -> None:
    await keepers.start()
    pod = await sandbox.create("pods", gpu_pod("steady"), "default")
    uid = pod["metadata"]["uid"]
    await keepers.decision(lambda d: d.outcome == "written")
    configmap = pod["metadata"]["annotations"]["runai/shared-gpu-configmap"] + "-0"
    sandbox.delete("configmaps", "default", configmap)
    # The tenant raises its annotation too: both inputs now agree on more.
    sandbox.patch("pods", "default", "steady", "application/merge-patch+json", {"metadata": {"annotations": {"gpu-memory": "15000"}}})
    kept = await keepers.decision(lambda d: d.outcome == "kept")
    assert kept.limit_bytes == 4147 * MIB
    await sandbox.create("configmaps", {"metadata": {"name": configmap}, "data": {"CUDA_DEVICE_MEMORY_LIMIT": "15000m", "NVIDIA_VISIBLE_DEVICES": fake_gpu_uuid(0)}}, "default")
    sandbox.patch("pods", "default", "steady", "application/merge-patch+json", {"metadata": {"labels": {"poke": "1"}, "annotations": {"gpu-memory": "15001"}}})
    await keepers.decision(lambda d: d.outcome == "kept" and any(r.code == "grant-kept" for r in d.reasons))
    assert read_grant(keepers.root, uid, "main").devices[0].limit_bytes == 4147 * MIB  # type: ignore[union-attr]


async def test_restart_keeps_grants_untouched_and_drops_those_of_pods_deleted_meanwhile(sandbox: SandboxApi, keepers: Keepers) -> None:
    await keepers.start()
    staying = await sandbox.create("pods", gpu_pod("staying"), "default")
    leaving = await sandbox.create("pods", gpu_pod("leaving"), "default")
    for pod in (staying, leaving):
        await wait_for_file(grant_path(keepers.root, pod["metadata"]["uid"], "main"))
    inode = grant_path(keepers.root, staying["metadata"]["uid"], "main").stat().st_ino
    await keepers.stop()
    sandbox.delete("pods", "default", "leaving")
    sandbox.compact()  # and the change history is gone: no watch can resume
    await keepers.start()
    assert grant_path(keepers.root, staying["metadata"]["uid"], "main").stat().st_ino == inode
    assert not grant_path(keepers.root, leaving["metadata"]["uid"], "main").parent.exists()


async def test_a_410_mid_watch_relists_and_misses_nothing(sandbox: SandboxApi, keepers: Keepers) -> None:
    await keepers.start()
    sandbox.compact()
    pod = await sandbox.create("pods", gpu_pod("after-compaction"), "default")
    await wait_for_file(grant_path(keepers.root, pod["metadata"]["uid"], "main"))


async def test_the_node_agent_writes_grants_and_publishes_decisions_on_the_bus(sandbox: SandboxApi, start_agent: Any, bus_settings: BusSettings) -> None:
    nc = await nats.connect(bus_settings.nats_url)
    received: list[GrantDecision] = []

    async def collect(msg: Any) -> None:
        _, payload = decode(msg.data)
        assert isinstance(payload, GrantDecision) and msg.subject == subjects.grant(payload.pod.namespace, payload.pod.name)
        received.append(payload)

    await nc.subscribe(subjects.ALL_GRANTS, cb=collect)
    try:
        agent = await start_agent(NODE, kubeconfig=sandbox.settings.kubeconfig)
        pod = await sandbox.create("pods", gpu_pod("via-agent"), "default")
        path = grant_path(agent.grant_root, pod["metadata"]["uid"], "main")
        await wait_for_file(path)
        assert agent.grant_root == agent.settings.host_root / "var/lib/kai-isolator/grants"
        assert json.loads(path.read_text())["devices"] == [{"uuid": fake_gpu_uuid(0), "limit_bytes": 4147 * MIB}]
        deadline = time.monotonic() + 10
        while not received:
            assert time.monotonic() < deadline, "no grant decision on the bus"
            await asyncio.sleep(0.02)
        assert (received[0].outcome, received[0].node_name, received[0].pod.name) == ("written", NODE, "via-agent")
    finally:
        await nc.drain()


async def test_an_agent_with_a_broken_kubeconfig_stops_before_it_serves(start_agent: Any, tmp_path: Path) -> None:
    from kai_isolator.shared.errors import ConfigError

    (tmp_path / "kubeconfig").write_text("clusters: [not, a, kubeconfig")
    with pytest.raises(ConfigError, match="cannot load a Kubernetes client configuration"):
        await start_agent("broken", kubeconfig=tmp_path / "kubeconfig")


@pytest.mark.parametrize("content", ["[1, 2]", "just text", "clusters: {}\ncontexts: 3"])
async def test_kubeconfigs_that_are_not_kubeconfigs_are_a_clear_error(tmp_path: Path, content: str) -> None:
    from kai_isolator.services.nodeagent.grants import api_client
    from kai_isolator.shared.errors import ConfigError

    (tmp_path / "kubeconfig").write_text(content)
    with pytest.raises(ConfigError, match="cannot load a Kubernetes client configuration"):
        await api_client(tmp_path / "kubeconfig")
