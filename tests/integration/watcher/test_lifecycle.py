"""Pod lifecycle in the sandbox -> exactly the expected PodIsolation events on the bus."""

from __future__ import annotations

from kai_isolator.services.sandbox.api import SandboxApi
from support import eventually

from .conftest import PodEvents, gpu_pod


async def test_lifecycle_gives_exact_story(sandbox: SandboxApi, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await sandbox.create("pods", gpu_pod("train", injected=True), "default")
    await sandbox.create("pods", {"metadata": {"name": "plain"}, "spec": {"containers": [{"name": "c", "image": "busybox"}], "nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"}}}, "default")
    await eventually(lambda: "running" in pod_events.states("train"))
    sandbox.nodes.finish("default", "train", 0)
    await eventually(lambda: "finished" in pod_events.states("train"))
    sandbox.delete("pods", "default", "train")
    await eventually(lambda: "deleted" in pod_events.states("train"))

    assert pod_events.states("train") == ["admitted", "scheduled", "running", "finished", "deleted"]
    assert pod_events.states("plain") == []
    running = next(e for e in pod_events.received if e.state == "running")
    assert running.expected_limit == "4147m"  # 4096 MiB on the 15360 MiB simulated T4, as KAI computes it
    assert running.injected and running.container == "main" and running.node_name == "gpu-node-1"
    assert running.gpu_memory == "4096" and running.phase == "Running"


async def test_pod_without_injection_is_reported_missing(sandbox: SandboxApi, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await sandbox.create("pods", gpu_pod("bare", node=None), "default")
    await sandbox.create("pods", gpu_pod("optout", node=None, annotations={"kai-resource-isolator.io/inject": "false"}), "default")
    await eventually(lambda: len(pod_events.states("bare")) == 2 and len(pod_events.states("optout")) == 2)

    assert pod_events.states("bare") == ["admitted", "isolation-missing"]
    missing = {e.pod.name: e for e in pod_events.received if e.state == "isolation-missing"}
    assert [r.code for r in missing["bare"].reasons] == ["not-injected"]
    assert [r.code for r in missing["optout"].reasons] == ["opted-out"]
    assert not missing["bare"].injected


async def test_node_scoped_watcher_sees_only_its_node(sandbox: SandboxApi, start_watcher, pod_events: PodEvents) -> None:
    sandbox.nodes.add_node("gpu-node-2", 40960)
    watcher, _ = await start_watcher(node="gpu-node-2")
    await sandbox.create("pods", gpu_pod("there", node="gpu-node-2", injected=True), "default")
    await sandbox.create("pods", gpu_pod("elsewhere", node="gpu-node-1", injected=True), "default")
    await eventually(lambda: pod_events.states("there") == ["admitted", "scheduled", "running"])
    await eventually(lambda: sandbox.get("pods", "default", "elsewhere")["status"]["phase"] == "Running")
    sandbox.delete("pods", "default", "there")
    await eventually(lambda: "deleted" in pod_events.states("there"))
    assert pod_events.states("elsewhere") == []
    running = next(e for e in pod_events.received if e.state == "running")
    assert running.expected_limit == "4505m"  # 4096 / 40900 rounds up to 0.11; int(40960 x 0.11) = 4505
    assert watcher.settings.scope == "node.gpu-node-2"


async def test_a_pod_that_lost_its_gpu_annotations_still_ends_with_deleted(sandbox: SandboxApi, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await sandbox.create("pods", gpu_pod("renamed", injected=True), "default")
    await eventually(lambda: "running" in pod_events.states("renamed"))
    sandbox.patch("pods", "default", "renamed", "application/merge-patch+json", {"metadata": {"annotations": {"gpu-memory": None}}})
    sandbox.delete("pods", "default", "renamed")
    await eventually(lambda: "deleted" in pod_events.states("renamed"))
    assert pod_events.states("renamed") == ["admitted", "scheduled", "running", "deleted"]


async def test_readyz_waits_for_the_first_reconciled_list(sandbox: SandboxApi, start_watcher) -> None:
    watcher, _ = await start_watcher()
    await eventually(lambda: watcher.synced.is_set())
    assert watcher.runtime.not_ready() == []
    watcher.synced.clear()
    assert watcher.runtime.not_ready() == ["first pod list not reconciled yet"]
