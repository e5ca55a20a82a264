"""The node agent as its ServiceAccount: node-scoped pod watch, KAI's ConfigMap and its Node read, a grant written; its Event posted."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from kubernetes_asyncio import config

from kai_isolator.services.devcluster.kai import fake_gpu_uuid, kai_admit
from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.services.nodeagent.grant_files import grant_path, read_grant
from kai_isolator.services.nodeagent.grants import GrantKeeper
from kai_isolator.shared.events import GrantDecision, PodRef
from kai_isolator.shared.grant import GrantSource
from kai_isolator.shared.kube_events import post_event
from support.control_plane import Cluster, GpuNode, NO_WEBHOOK
from support.pods import gpu_pod, make_namespace
from support.webhook import NAMESPACE


MIB = 1 << 20


async def _until(predicate, timeout_s: float = 15) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_grants_and_events_under_the_node_agents_rbac(control_plane: ControlPlane, gpu_node: GpuNode, deployed: list[dict],
                                                            tmp_path: Path) -> None:
    ns = make_namespace(control_plane, "granted", labels=NO_WEBHOOK)
    cluster = Cluster(control_plane, gpu_node, ns)
    kubeconfig = control_plane.service_account_kubeconfig(NAMESPACE, "kai-resource-isolator-nodeagent")
    decisions: list[GrantDecision] = []

    async def publish(decision: GrantDecision) -> None:
        decisions.append(decision)

    root = tmp_path / "grants"
    async with await config.new_client_from_config(config_file=str(kubeconfig)) as api:
        keeper = GrantKeeper(api, gpu_node.name, root, publish, retry_s=0.05, stale_grace_s=0)
        task = asyncio.create_task(keeper.run())
        try:
            await asyncio.wait_for(keeper.synced.wait(), 10)
            pod = cluster.create(kai_admit(gpu_pod("train", injected=True)))
            cluster.start("train")
            uid = pod["metadata"]["uid"]
            await _until(lambda: any(d.outcome == "written" and d.pod.uid == uid for d in decisions))
            grant = read_grant(root, uid, "main")
            assert grant is not None and grant.source is GrantSource.CONFIGMAP
            assert [(d.uuid, d.limit_bytes) for d in grant.devices] == [(fake_gpu_uuid(0), 4147 * MIB)]
            assert await post_event(api, PodRef(namespace=ns, name="train", uid=uid), reason="IsolationBreached", kind="Warning",
                                    message="container main: over its grant", key="breach-1", component="kai-isolator-nodeagent",
                                    container="main")
            cluster.delete("train")
            await _until(lambda: any(d.outcome == "removed" and d.pod.uid == uid for d in decisions))
            assert not grant_path(root, uid, "main").exists()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    events = control_plane.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert [e["reason"] for e in events] == ["IsolationBreached"]
