"""What the node agent does where KAI gives it no limit, on the real API server with KAI simulated (held to the real
KAI's admission in tests/kai): KAI without its hamicore plugin, a GPU annotation under the default scheduler, and a
node without the `nvidia.com/gpu.memory` label (KAI before PR #2157 binds without a limit). In each the agent writes
no grant, so libvgpu.so fails closed and the enforcer holds the container to nothing; the pod says why in a
GrantWithheld Event instead of its allocations failing silently after the library's wait."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.kai import GPU_MEMORY_LABEL, KaiOptions
from kai_isolator.services.nodeagent.grant_files import grant_path
from support.pods import T4, Obj, kai_pod

NODE = T4


async def withheld_event(cluster: DevCluster, uid: str, timeout_s: float = 10) -> Obj:
    deadline = time.monotonic() + timeout_s
    while True:
        events = [e for e in await cluster.list("events", "default")
                  if e.get("reason") == "GrantWithheld" and e["involvedObject"].get("uid") == uid]
        if events:
            return events[0]
        assert time.monotonic() < deadline, "no GrantWithheld Event"
        await asyncio.sleep(0.05)


async def test_kai_without_hamicore_gets_a_withheld_event_naming_the_plugin(dev_cluster: DevCluster, start_agent: Any) -> None:
    agent = await start_agent(NODE, kubeconfig=dev_cluster.kubeconfig)
    assert dev_cluster.scheduler is not None
    dev_cluster.kai_admission.options = dev_cluster.scheduler.options = KaiOptions(hamicore=False)
    pod = await dev_cluster.create("pods", kai_pod("no-hamicore", **{"gpu-memory": "4096"}), "default")
    event = await withheld_event(dev_cluster, pod["metadata"]["uid"])
    assert event["type"] == "Warning" and "limit-missing" in event["message"] and "hamicore plugin off" in event["message"]
    assert not grant_path(agent.settings.host_root / agent.settings.grant_dir.lstrip("/"), pod["metadata"]["uid"], "main").exists()


async def test_a_gpu_annotation_under_the_default_scheduler_is_named_not_kais(dev_cluster: DevCluster, start_agent: Any) -> None:
    await start_agent(NODE, kubeconfig=dev_cluster.kubeconfig)
    pod = await dev_cluster.create("pods", kai_pod("default-scheduled", scheduler=None, **{"gpu-memory": "4096"}), "default")
    event = await withheld_event(dev_cluster, pod["metadata"]["uid"])
    assert "not-admitted-by-kai" in event["message"] and "set schedulerName: kai-scheduler" in event["message"]
    assert "limit-missing" not in event["message"]


async def test_a_node_without_the_memory_label_runs_no_unenforced_pod_before_pr_2157(dev_cluster: DevCluster, start_agent: Any) -> None:
    """KAI before #2157 binds a fraction there with no limit; the agent grants nothing and says why (after #2157 the
    pod stays Pending: tests/integration/devcluster/test_kai_simulation.py)."""
    await dev_cluster.patch("nodes", None, NODE, {"metadata": {"labels": {GPU_MEMORY_LABEL: None}}})
    await start_agent(NODE, kubeconfig=dev_cluster.kubeconfig)
    pod = await dev_cluster.create("pods", kai_pod("unlabelled", **{"gpu-fraction": "0.5"}), "default")
    event = await withheld_event(dev_cluster, pod["metadata"]["uid"])
    assert "limit-missing" in event["message"] and "wrote none into its ConfigMap" in event["message"]
    assert "node-label-invalid" in event["message"]
