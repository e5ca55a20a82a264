"""Grants on the real kube-apiserver (`dev_cluster`, KAI simulated through it): the node agent watches the pods
bound to its node, writes each GPU-sharing container's grant once KAI's ConfigMap exists, publishes why on the
bus, survives restarts and 410s, and removes the grant with the pod."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from kubernetes_asyncio import client, config

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.kai import CONFIGMAP_ANNOTATION, fake_gpu_uuid, gpu_group_labels, reservation_pod, reserve
from kai_isolator.services.nodeagent.grant_files import grant_path, read_grant
from kai_isolator.services.nodeagent.grants import GrantKeeper
from kai_isolator.shared import subjects
from kai_isolator.shared.events import GrantDecision, decode
from kai_isolator.shared.grant import GrantSource
from kai_isolator.shared.settings import BusSettings
from support.pods import T4, Obj, gpu_pod
from support.waiting import eventually

NODE = T4
MIB = 1 << 20


@pytest.fixture
def dev_cluster_options() -> dict[str, Any]:
    """Two GPU nodes: the keeper's and another, whose pods it must leave alone."""
    return {"nodes": {NODE: 15360, "gpu-node-2": 15360}, "step_s": 0.02}


@pytest.fixture
async def api(dev_cluster: DevCluster) -> AsyncIterator[client.ApiClient]:
    api_client = await config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    async with api_client:
        yield api_client


class Keepers:
    """GrantKeepers on one host's grant dir, started and stopped like agent restarts; decisions collected,
    and how often each keeper listed and looked at each pod counted (the keeper's own methods, wrapped)."""

    def __init__(self, api: client.ApiClient, root: Path) -> None:
        self.api = api
        self.root = root
        self.decisions: list[GrantDecision] = []
        self.task: asyncio.Task[None] | None = None
        self.keeper: GrantKeeper | None = None
        self.relists = 0
        self.looks: Counter[str] = Counter()

    async def publish(self, event: GrantDecision) -> None:
        self.decisions.append(event)

    async def start(self, node: str = NODE) -> GrantKeeper:
        # A short backoff: the API server restarts in these tests, and a reconnect should not wait out 10 s.
        keeper = GrantKeeper(self.api, node, self.root, self.publish, retry_s=0.05, stale_grace_s=0, backoff_max_s=0.5)
        relist, on_pod = keeper._relist, keeper.on_pod

        async def counted_relist() -> str:
            self.relists += 1
            return await relist()

        async def counted_on_pod(pod: dict[str, Any]) -> None:
            await on_pod(pod)
            self.looks[str((pod.get("metadata") or {}).get("uid"))] += 1

        keeper._relist, keeper.on_pod = counted_relist, counted_on_pod  # type: ignore[method-assign]
        self.keeper, self.relists = keeper, 0
        self.task = asyncio.create_task(keeper.run())
        await asyncio.wait_for(keeper.synced.wait(), 10)
        return keeper

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


def placed(name: str, configmap: str) -> Obj:
    """A KAI pod created bound, as if KAI's binder had placed it on the node's first GPU (its GPU-group label;
    `reserved` makes the reservation pod) but written no ConfigMap (`configmap`, the name KAI's admission gave it)."""
    return gpu_pod(name, node_name=NODE, labels=gpu_group_labels(NODE, [0]), annotations={CONFIGMAP_ANNOTATION: configmap})


async def reserved(cluster: DevCluster, node: str = NODE) -> None:
    """KAI's reservation pod for the node's first GPU, as its binder makes it before it binds a share there."""
    assert cluster.api is not None
    await reserve(cluster.api, reservation_pod(node, 0))


async def wait_for_file(path: Path, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.02)


async def restart_apiserver_abruptly(cluster: DevCluster) -> None:
    """kube-apiserver killed (every watch on it cut, no bookmark said goodbye) and started again on the same port
    and store. Killed rather than stopped: a SIGTERM waits out the open watches for the plane's full 10 s."""
    plane = cluster.plane
    assert plane is not None and plane._apiserver is not None
    os.killpg(plane._apiserver.pid, signal.SIGKILL)  # its own session: the group is the process the plane started
    await asyncio.to_thread(plane._apiserver.wait, 10)
    await asyncio.to_thread(plane._start_apiserver, "kube-apiserver restart")


async def bound_to(cluster: DevCluster, name: str, timeout_s: float = 10) -> str:
    """The node KAI's simulated scheduler bound the pod to, once it has."""
    deadline = time.monotonic() + timeout_s
    while not (node := (await cluster.get("pods", "default", name))["spec"].get("nodeName")):
        assert time.monotonic() < deadline, f"{name} never bound"
        await asyncio.sleep(0.02)
    return str(node)


async def test_a_bound_pod_gets_its_grant_from_kais_configmap_and_loses_it_when_deleted(dev_cluster: DevCluster, keepers: Keepers) -> None:
    await keepers.start()
    pod = await dev_cluster.create("pods", gpu_pod("train", node=NODE), "default")
    uid = pod["metadata"]["uid"]
    path = grant_path(keepers.root, uid, "main")
    await wait_for_file(path)
    grant = read_grant(keepers.root, uid, "main")
    assert grant is not None and (grant.namespace, grant.pod, grant.container) == ("default", "train", "main")
    assert [(d.uuid, d.limit_bytes) for d in grant.devices] == [(fake_gpu_uuid(0), 4147 * MIB)] and grant.source is GrantSource.CONFIGMAP
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    written = await keepers.decision(lambda d: d.outcome == "written")
    assert (written.pod.uid, written.limit_bytes, written.devices, written.reasons) == (uid, 4147 * MIB, [fake_gpu_uuid(0)], [])
    await dev_cluster.delete("pods", "default", "train")
    await keepers.decision(lambda d: d.outcome == "removed" and d.container == "main")
    assert not path.parent.exists()


async def test_pods_of_other_nodes_and_pods_not_sharing_a_gpu_get_nothing(dev_cluster: DevCluster, keepers: Keepers) -> None:
    await keepers.start()
    elsewhere = await dev_cluster.create("pods", gpu_pod("elsewhere", node="gpu-node-2"), "default")
    plain = gpu_pod("plain", node=NODE)
    plain["metadata"]["annotations"] = {}
    await dev_cluster.create("pods", plain, "default")
    await dev_cluster.create("pods", gpu_pod("here", node=NODE), "default")
    await keepers.decision(lambda d: d.pod.name == "here" and d.outcome == "written")
    # The other node's pod really is bound (to gpu-node-2), so leaving it alone is the keeper's doing.
    assert await bound_to(dev_cluster, "elsewhere") == "gpu-node-2"
    assert elsewhere["metadata"]["uid"] not in keepers.looks
    assert {d.pod.name for d in keepers.decisions} == {"here"}
    assert len(list(keepers.root.iterdir())) == 1


async def test_a_missing_configmap_is_waited_for_and_a_tenant_raised_limit_loses(dev_cluster: DevCluster, keepers: Keepers) -> None:
    await keepers.start()
    # Created bound: no binder ran, so no ConfigMap was written (KAI's admission keeps the ConfigMap name it is given).
    await reserved(dev_cluster)
    pod = await dev_cluster.create("pods", placed("early", "early-cm"), "default")
    uid = pod["metadata"]["uid"]
    withheld = await keepers.decision(lambda d: d.outcome == "withheld")
    assert [r.code for r in withheld.reasons] == ["configmap-missing"] and "early-cm-0" in withheld.reasons[0].message
    assert not grant_path(keepers.root, uid, "main").exists()
    looked = keepers.looks[uid]
    await eventually(lambda: keepers.looks[uid] >= looked + 3, what="three more retries")  # the same fact is published once
    assert len([d for d in keepers.decisions if d.outcome == "withheld"]) == 1
    # The tenant writes the ConfigMap itself, with the whole card.
    await dev_cluster.create("configmaps", {"metadata": {"name": "early-cm-0"},
                                            "data": {"CUDA_DEVICE_MEMORY_LIMIT": "15g", "NVIDIA_VISIBLE_DEVICES": fake_gpu_uuid(0)}}, "default")
    written = await keepers.decision(lambda d: d.outcome == "written")
    assert written.source == "annotation" and written.limit_bytes == 4147 * MIB and written.configmap_limit_bytes == 15 << 30
    assert [r.code for r in written.reasons] == ["limit-disagrees"]
    grant = read_grant(keepers.root, uid, "main")
    assert grant is not None and grant.devices[0].limit_bytes == 4147 * MIB and "smaller is granted" in grant.reason


async def test_bad_inputs_withhold_the_grant_with_a_reason(dev_cluster: DevCluster, keepers: Keepers) -> None:
    await keepers.start()
    await dev_cluster.create("configmaps", {"metadata": {"name": "bad-cm-0"},
                                            "data": {"CUDA_DEVICE_MEMORY_LIMIT": "4147m", "NVIDIA_VISIBLE_DEVICES": "all"}}, "default")
    pod = await dev_cluster.create("pods", placed("bad", "bad-cm"), "default")
    withheld = await keepers.decision(lambda d: d.outcome == "withheld")
    assert [r.code for r in withheld.reasons] == ["devices-invalid"] and "'all'" in withheld.reasons[0].message
    assert not grant_path(keepers.root, pod["metadata"]["uid"], "main").parent.exists()


async def test_a_written_grant_survives_a_deleted_configmap_and_is_never_raised(dev_cluster: DevCluster, keepers: Keepers) -> None:
    await keepers.start()
    pod = await dev_cluster.create("pods", gpu_pod("steady", node=NODE), "default")
    uid = pod["metadata"]["uid"]
    await keepers.decision(lambda d: d.outcome == "written")
    configmap = pod["metadata"]["annotations"]["runai/shared-gpu-configmap"] + "-0"  # the name KAI's admission chose
    await dev_cluster.delete("configmaps", "default", configmap)
    # The tenant raises its annotation too: both inputs now agree on more.
    await dev_cluster.patch("pods", "default", "steady", {"metadata": {"annotations": {"gpu-memory": "15000"}}})
    kept = await keepers.decision(lambda d: d.outcome == "kept")
    assert kept.limit_bytes == 4147 * MIB
    await dev_cluster.create("configmaps", {"metadata": {"name": configmap},
                                            "data": {"CUDA_DEVICE_MEMORY_LIMIT": "15000m", "NVIDIA_VISIBLE_DEVICES": fake_gpu_uuid(0)}}, "default")
    await dev_cluster.patch("pods", "default", "steady", {"metadata": {"labels": {"poke": "1"}, "annotations": {"gpu-memory": "15001"}}})
    await keepers.decision(lambda d: d.outcome == "kept" and any(r.code == "grant-kept" for r in d.reasons))
    assert read_grant(keepers.root, uid, "main").devices[0].limit_bytes == 4147 * MIB  # type: ignore[union-attr]


async def test_restart_keeps_grants_untouched_and_drops_those_of_pods_deleted_meanwhile(dev_cluster: DevCluster, keepers: Keepers) -> None:
    await keepers.start()
    staying = await dev_cluster.create("pods", gpu_pod("staying", node=NODE), "default")
    leaving = await dev_cluster.create("pods", gpu_pod("leaving", node=NODE), "default")
    for pod in (staying, leaving):
        await wait_for_file(grant_path(keepers.root, pod["metadata"]["uid"], "main"))
    inode = grant_path(keepers.root, staying["metadata"]["uid"], "main").stat().st_ino
    await keepers.stop()
    await dev_cluster.delete("pods", "default", "leaving")
    await dev_cluster.wait_gone("pods", "default", "leaving")  # gone for good, not just marked for deletion, while no keeper ran
    await dev_cluster.compact()  # and the change history is gone: no watch can resume
    await keepers.start()
    assert grant_path(keepers.root, staying["metadata"]["uid"], "main").stat().st_ino == inode
    assert not grant_path(keepers.root, leaving["metadata"]["uid"], "main").parent.exists()


async def test_a_410_mid_watch_relists_and_misses_nothing(dev_cluster: DevCluster, keepers: Keepers) -> None:
    await keepers.start()
    before = await dev_cluster.create("pods", gpu_pod("before", node=NODE), "default")
    before_grant = grant_path(keepers.root, before["metadata"]["uid"], "main")
    await wait_for_file(before_grant)
    await keepers.decision(lambda d: d.pod.name == "before" and d.outcome == "written")
    inode = before_grant.stat().st_ino
    # The store moves past the last version the keeper saw (a change it does not watch), that history is
    # compacted away, and the API server restarts: its new watch cache begins at the current revision, so the
    # keeper's resumed watch is answered 410 Gone, as etcd's compaction does on a long-running cluster.
    await dev_cluster.create("configmaps", {"metadata": {"name": "elsewhere"}, "data": {"moves": "the revision"}}, "default")
    await dev_cluster.compact()
    assert keepers.relists == 1
    await restart_apiserver_abruptly(dev_cluster)
    after = await dev_cluster.create("pods", gpu_pod("after-compaction", node=NODE), "default")
    await wait_for_file(grant_path(keepers.root, after["metadata"]["uid"], "main"), timeout_s=30)
    assert keepers.relists == 2  # resumed, met 410, relisted once
    assert before_grant.stat().st_ino == inode  # the relist left the grant it already had alone
    await dev_cluster.delete("pods", "default", "before")
    await keepers.decision(lambda d: d.pod.name == "before" and d.outcome == "removed")  # still watching after it


async def test_the_node_agent_writes_grants_and_publishes_decisions_on_the_bus(dev_cluster: DevCluster, start_agent: Any,
                                                                               bus_settings: BusSettings) -> None:
    nc = await nats.connect(bus_settings.nats_url)
    received: list[GrantDecision] = []

    async def collect(msg: Any) -> None:
        _, payload = decode(msg.data)
        assert isinstance(payload, GrantDecision) and msg.subject == subjects.grant(payload.pod.namespace, payload.pod.name)
        received.append(payload)

    await nc.subscribe(subjects.ALL_GRANTS, cb=collect)
    try:
        agent = await start_agent(NODE, kubeconfig=dev_cluster.kubeconfig)
        pod = await dev_cluster.create("pods", gpu_pod("via-agent", node=NODE), "default")
        path = grant_path(agent.grant_root, pod["metadata"]["uid"], "main")
        await wait_for_file(path)
        assert agent.grant_root == agent.settings.host_root / "var/lib/kai-isolator/grants"
        assert json.loads(path.read_text())["devices"] == [{"uuid": fake_gpu_uuid(0), "limit_bytes": 4147 * MIB}]
        await eventually(lambda: bool(received), what="a grant decision on the bus")
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


async def test_a_withheld_grant_is_written_on_the_pod_as_an_event_and_named_by_the_enforcer(dev_cluster: DevCluster, start_agent: Any) -> None:
    """Issue 26: the enforcer holds a target without a grant to nothing; the pod says why, in a GrantWithheld Event."""
    agent = await start_agent(NODE, kubeconfig=dev_cluster.kubeconfig)
    await dev_cluster.create("configmaps", {"metadata": {"name": "held-cm-0"},
                                            "data": {"CUDA_DEVICE_MEMORY_LIMIT": "4147m", "NVIDIA_VISIBLE_DEVICES": "all"}}, "default")
    pod = await dev_cluster.create("pods", placed("held", "held-cm"), "default")
    uid = pod["metadata"]["uid"]
    deadline = time.monotonic() + 10
    while not (events := [e for e in await dev_cluster.list("events", "default") if e.get("reason") == "GrantWithheld"]):
        assert time.monotonic() < deadline, "no GrantWithheld Event"
        await asyncio.sleep(0.05)
    [event] = events
    assert event["type"] == "Warning" and event["involvedObject"]["uid"] == uid and event["involvedObject"]["name"] == "held"
    assert "devices-invalid" in event["message"] and "'all'" in event["message"] and "kills what it holds" in event["message"]
    assert "devices-invalid" in (agent._withheld(uid, "main") or "")
