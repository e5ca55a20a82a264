"""Pod lifecycle on the real API server (KAI and the GPU node simulated through it) -> exactly the expected
PodIsolation events on the bus."""

from __future__ import annotations

from kai_isolator.services.devcluster.cluster import DevCluster
from support.pods import T4, gpu_pod
from support.waiting import eventually

from .conftest import PodEvents, wait_phase


async def test_lifecycle_gives_exact_story(dev_cluster: DevCluster, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await dev_cluster.create("pods", gpu_pod("train", node=T4, injected=True), "default")
    await dev_cluster.create("pods", {"metadata": {"name": "plain"}, "spec": {"containers": [{"name": "c", "image": "busybox"}], "nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"}}}, "default")
    await eventually(lambda: "running" in pod_events.states("train"))
    await dev_cluster.finish("default", "train", 0)
    await eventually(lambda: "finished" in pod_events.states("train"))
    # Graceful on the real API server: the pod is gone once the node's kubelet confirms, which the watcher hears as DELETED.
    await dev_cluster.delete("pods", "default", "train")
    await eventually(lambda: "deleted" in pod_events.states("train"))
    await wait_phase(dev_cluster, "plain", "Running")  # the non-GPU pod ran its course too, and was never told about

    assert pod_events.states("train") == ["admitted", "scheduled", "running", "finished", "deleted"]
    assert pod_events.states("plain") == []
    running = next(e for e in pod_events.received if e.state == "running")
    assert running.expected_limit == "4147m"  # 4096 MiB on the 15360 MiB simulated T4, from the ConfigMap KAI's binder wrote
    assert running.injected and running.container == "main" and running.node_name == "gpu-node-1"
    assert running.gpu_memory == "4096" and running.phase == "Running"


async def test_pod_without_injection_is_reported_missing(dev_cluster: DevCluster, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await dev_cluster.create("pods", gpu_pod("bare", scheduler=None), "default")
    await dev_cluster.create("pods", gpu_pod("optout", scheduler=None, annotations={"kai-resource-isolator.io/inject": "false"}), "default")
    await eventually(lambda: len(pod_events.states("bare")) == 2 and len(pod_events.states("optout")) == 2)

    assert pod_events.states("bare") == ["admitted", "isolation-missing"]
    missing = {e.pod.name: e for e in pod_events.received if e.state == "isolation-missing"}
    assert [r.code for r in missing["bare"].reasons] == ["not-injected"]
    assert [r.code for r in missing["optout"].reasons] == ["opted-out"]
    assert not missing["bare"].injected


async def test_node_scoped_watcher_sees_only_its_node(dev_cluster: DevCluster, start_watcher, pod_events: PodEvents) -> None:
    await dev_cluster.add_node("gpu-node-2", 40960)
    watcher, _ = await start_watcher(node="gpu-node-2")
    await dev_cluster.create("pods", gpu_pod("there", node="gpu-node-2", injected=True), "default")
    await dev_cluster.create("pods", gpu_pod("elsewhere", node="gpu-node-1", injected=True), "default")
    await eventually(lambda: pod_events.states("there") == ["admitted", "scheduled", "running"])
    await wait_phase(dev_cluster, "elsewhere", "Running")
    await dev_cluster.delete("pods", "default", "there")
    await eventually(lambda: "deleted" in pod_events.states("there"))
    assert pod_events.states("elsewhere") == []  # the real fieldSelector spec.nodeName=gpu-node-2 kept it out
    running = next(e for e in pod_events.received if e.state == "running")
    assert running.expected_limit == "4505m"  # 4096 / 40900 rounds up to 0.11; int(40960 x 0.11) = 4505
    assert watcher.settings.scope == "node.gpu-node-2"


async def test_a_pod_that_lost_its_gpu_annotations_still_ends_with_deleted(dev_cluster: DevCluster, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await dev_cluster.create("pods", gpu_pod("renamed", node=T4, injected=True), "default")
    await eventually(lambda: "running" in pod_events.states("renamed"))
    await dev_cluster.patch("pods", "default", "renamed", {"metadata": {"annotations": {"gpu-memory": None}}})
    await dev_cluster.delete("pods", "default", "renamed")
    await eventually(lambda: "deleted" in pod_events.states("renamed"))
    assert pod_events.states("renamed") == ["admitted", "scheduled", "running", "deleted"]


async def test_readyz_waits_for_the_first_reconciled_list(dev_cluster: DevCluster, start_watcher) -> None:
    watcher, _ = await start_watcher()
    await eventually(lambda: watcher.synced.is_set())
    assert watcher.runtime.not_ready() == []
    watcher.synced.clear()
    assert watcher.runtime.not_ready() == ["first pod list not reconciled yet"]
