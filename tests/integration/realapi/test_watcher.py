"""The watcher, as its ServiceAccount, through real list/watch: the pod story, an API server restart, a real compaction's 410."""

from __future__ import annotations

import asyncio
from collections import Counter

from kai_isolator.services.devcluster.kai import kai_admit
from kai_isolator.services.devcluster.plane import ControlPlane
from support.bus import PodEvents
from support.control_plane import Cluster, GpuNode, NO_WEBHOOK
from support.pods import gpu_pod, make_namespace
from support.waiting import eventually

STORY = ["admitted", "scheduled", "running"]


def _exactly_once(events: PodEvents) -> None:
    seen = Counter((e.pod.uid, e.state) for e in events.received)
    assert [key for key, n in seen.items() if n > 1] == []


async def test_the_pod_story_through_a_real_watch(control_plane: ControlPlane, gpu_node: GpuNode, start_watcher, pod_events: PodEvents) -> None:
    ns = make_namespace(control_plane, "story", labels=NO_WEBHOOK)
    cluster = Cluster(control_plane, gpu_node, ns)
    await start_watcher()
    cluster.create(kai_admit(gpu_pod("train", injected=True)))
    cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    cluster.create(kai_admit(gpu_pod("bare")))
    await eventually(lambda: pod_events.states("train", ns) == ["admitted"])
    cluster.start("train")
    await eventually(lambda: "running" in pod_events.states("train", ns))
    gpu_node.finish(cluster.get("train"))
    await eventually(lambda: "finished" in pod_events.states("train", ns))
    cluster.delete("train")
    await eventually(lambda: "deleted" in pod_events.states("train", ns))

    assert pod_events.states("train", ns) == [*STORY, "finished", "deleted"]
    assert pod_events.states("plain", ns) == []
    assert pod_events.states("bare", ns) == ["admitted", "isolation-missing"]
    running = next(e for e in pod_events.received if e.state == "running" and e.pod.namespace == ns)
    assert running.expected_limit == "4147m"  # from the ConfigMap the binder wrote: 4096 MiB on a 15360 MiB T4
    assert running.injected and running.container == "main" and running.node_name == gpu_node.name
    _exactly_once(pod_events)


async def test_the_watch_survives_an_api_server_restart(control_plane: ControlPlane, gpu_node: GpuNode, start_watcher, pod_events: PodEvents) -> None:
    ns = make_namespace(control_plane, "restart", labels=NO_WEBHOOK)
    cluster = Cluster(control_plane, gpu_node, ns)
    await start_watcher()
    cluster.create(kai_admit(gpu_pod("before", injected=True)))
    cluster.start("before")
    await eventually(lambda: pod_events.states("before", ns) == STORY)
    await asyncio.to_thread(control_plane.restart_apiserver)
    cluster.create(kai_admit(gpu_pod("after", injected=True)))
    cluster.start("after")
    cluster.delete("before")
    await eventually(lambda: pod_events.states("after", ns) == STORY and "deleted" in pod_events.states("before", ns), timeout_s=30)
    assert pod_events.states("before", ns) == [*STORY, "deleted"]
    _exactly_once(pod_events)


async def test_a_real_compaction_gives_410_and_the_relist_loses_no_deletion(control_plane: ControlPlane, gpu_node: GpuNode, start_watcher,
                                                                            pod_events: PodEvents) -> None:
    ns = make_namespace(control_plane, "compacted", labels=NO_WEBHOOK)
    cluster = Cluster(control_plane, gpu_node, ns)
    _, stack = await start_watcher()
    for name in ("keep", "doomed", "finishing"):
        cluster.create(kai_admit(gpu_pod(name, injected=True)))
        cluster.start(name)
    await eventually(lambda: all(pod_events.states(n, ns) == STORY for n in ("keep", "doomed", "finishing")))
    await stack.aclose()  # graceful: the resume version is saved in KV

    cluster.delete("doomed")
    gpu_node.finish(cluster.get("finishing"), 1)
    cluster.create(kai_admit(gpu_pod("newcomer")))
    compacted = control_plane.compact_etcd()
    # A fresh API server: its watch cache starts after the compaction, so the saved version is gone from both.
    await asyncio.to_thread(control_plane.restart_apiserver)

    watcher, _ = await start_watcher()
    await eventually(lambda: "deleted" in pod_events.states("doomed", ns) and "finished" in pod_events.states("finishing", ns)
                     and pod_events.states("newcomer", ns) == ["admitted", "isolation-missing"], timeout_s=30)
    assert compacted > 0
    assert watcher.metrics.relists._value.get() == 1  # it resumed, met 410 Gone, relisted once
    assert pod_events.states("doomed", ns) == [*STORY, "deleted"]
    assert pod_events.states("finishing", ns) == [*STORY, "finished"]
    assert pod_events.states("keep", ns) == STORY
    _exactly_once(pod_events)
