"""The simulated KAI's scheduler and binder on the real API server, against what KAI's source does (its admission is
held to the real binary in tests/kai): GPU memory booked per device, a node without the memory label planned at
100 MiB, the two binder behaviours of PR #2157 and the two roundings of PR #2041, several devices, CDI names,
init-container targets, hamicore off, and pods KAI does not schedule."""

from __future__ import annotations

import asyncio

import pytest

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.kai import (
    CDI_PREFIX, CONFIGMAP_ANNOTATION, GPU_COUNT_LABEL, GPU_GROUP_LABEL, GPU_MEMORY_LABEL, LIMIT_ENV, RECEIVED_TYPE_ANNOTATION, KaiOptions,
    fake_gpu_uuid, gpu_group,
)
from kai_isolator.services.devcluster.plane import ApiCallError
from support.pods import T4, Obj, kai_pod
from support.waiting import eventually



async def bound(cluster: DevCluster, name: str) -> Obj:
    async def check() -> Obj | None:
        pod = await cluster.get("pods", "default", name)
        return pod if pod["spec"].get("nodeName") else None
    return await eventually(check, 10, what=f"pod {name} bound", every_s=0.05)  # type: ignore[no-any-return]


async def still_pending(cluster: DevCluster, name: str, for_s: float = 1.5) -> Obj:
    """Unbound after several of the scheduler's retries."""
    await asyncio.sleep(for_s)
    pod = await cluster.get("pods", "default", name)
    assert not pod["spec"].get("nodeName"), f"{name} was bound to {pod['spec'].get('nodeName')}"
    return pod


async def capabilities(cluster: DevCluster, pod: Obj, index: str = "0") -> Obj:
    return await cluster.get("configmaps", "default", f"{pod['metadata']['annotations'][CONFIGMAP_ANNOTATION]}-{index}")


async def gpu_node(cluster: DevCluster, name: str, memory_mib: int | None, gpus: int = 1) -> None:
    """A simulated node with `gpus` cards of `memory_mib` each, or no memory label at all (None)."""
    await cluster.add_node(name, memory_mib or 15360)
    await cluster.patch("nodes", None, name, {"metadata": {"labels": {GPU_MEMORY_LABEL: str(memory_mib) if memory_mib else None,
                                                                      GPU_COUNT_LABEL: str(gpus)}}})


async def test_three_4096_pods_fill_a_t4_and_the_fourth_waits_for_room(dev_cluster: DevCluster) -> None:
    for i in range(3):
        await dev_cluster.create("pods", kai_pod(f"share-{i}", **{"gpu-memory": "4096"}))
    first = [await bound(dev_cluster, f"share-{i}") for i in range(3)]
    assert {p["metadata"]["labels"][GPU_GROUP_LABEL] for p in first} == {gpu_group(T4, 0)}
    assert all(p["metadata"]["annotations"][RECEIVED_TYPE_ANNOTATION] == "Fraction" for p in first)
    await dev_cluster.create("pods", kai_pod("share-3", **{"gpu-memory": "4096"}))
    await still_pending(dev_cluster, "share-3")  # 15300 MiB planned, 3 x 4096 booked: 4096 more do not fit
    await dev_cluster.delete("pods", "default", "share-0", grace_period_s=0)
    fourth = await bound(dev_cluster, "share-3")
    assert (await capabilities(dev_cluster, fourth))["data"][LIMIT_ENV] == "4147m"


async def test_a_node_without_the_memory_label_before_and_after_pr_2157(dev_cluster: DevCluster) -> None:
    """KAI plans such a node at 100 MiB: gpu-memory pods never fit; a fraction fits, and its bind then writes no limit
    (before #2157) or fails (after), leaving the pod Pending and no ConfigMap."""
    await gpu_node(dev_cluster, "unlabelled", None)
    await dev_cluster.create("pods", kai_pod("by-memory", node="unlabelled", **{"gpu-memory": "1024"}))
    await dev_cluster.create("pods", kai_pod("by-fraction", node="unlabelled", **{"gpu-fraction": "0.5"}))
    pod = await bound(dev_cluster, "by-fraction")
    data = (await capabilities(dev_cluster, pod))["data"]
    assert LIMIT_ENV not in data and data["GPU_PORTION"] == "0.50" and data["NVIDIA_VISIBLE_DEVICES"] == fake_gpu_uuid(0)
    await still_pending(dev_cluster, "by-memory")
    assert dev_cluster.scheduler is not None
    dev_cluster.scheduler.options = KaiOptions(fail_bind_without_limit=True)
    after = await dev_cluster.create("pods", kai_pod("after-2157", node="unlabelled", **{"gpu-fraction": "0.25"}))
    await still_pending(dev_cluster, "after-2157")
    with pytest.raises(ApiCallError) as missing:
        await capabilities(dev_cluster, after)
    assert missing.value.code == 404


@pytest.mark.parametrize(("floor", "portion", "limit"), [(True, "0.26", "4259m"), (False, "0.25", "4096m")])
async def test_a_16384_card_before_and_after_pr_2041(dev_cluster: DevCluster, floor: bool, portion: str, limit: str) -> None:
    await gpu_node(dev_cluster, "a16", 16384)
    assert dev_cluster.scheduler is not None
    dev_cluster.scheduler.options = KaiOptions(floor_gpu_memory=floor)
    await dev_cluster.create("pods", kai_pod("rounded", node="a16", **{"gpu-memory": "4096"}))
    data = (await capabilities(dev_cluster, await bound(dev_cluster, "rounded")))["data"]
    assert (data["GPU_PORTION"], data[LIMIT_ENV]) == (portion, limit)


@pytest.mark.parametrize("cdi", [False, True])
async def test_several_devices_get_one_portion_each_and_every_uuid(dev_cluster: DevCluster, cdi: bool) -> None:
    await gpu_node(dev_cluster, "two-gpus", 15360, gpus=2)
    assert dev_cluster.scheduler is not None
    dev_cluster.scheduler.options = KaiOptions(cdi=cdi)
    await dev_cluster.create("pods", kai_pod("multi", node="two-gpus", **{"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}))
    pod = await bound(dev_cluster, "multi")
    data = (await capabilities(dev_cluster, pod))["data"]
    prefix = CDI_PREFIX if cdi else ""
    assert data["NVIDIA_VISIBLE_DEVICES"] == f"{prefix}{fake_gpu_uuid(0)},{prefix}{fake_gpu_uuid(1)}"
    assert (data["GPU_PORTION"], data[LIMIT_ENV]) == ("0.50", "7680m")  # per device
    groups = {k: v for k, v in pod["metadata"]["labels"].items() if k.startswith(GPU_GROUP_LABEL)}
    assert groups == {f"{GPU_GROUP_LABEL}/{gpu_group('two-gpus', i)}": gpu_group("two-gpus", i) for i in (0, 1)}
    await dev_cluster.create("pods", kai_pod("multi-on-one", node=T4, **{"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}))
    await still_pending(dev_cluster, "multi-on-one")  # one card cannot hold two devices' shares


async def test_an_init_container_target_gets_its_i_index_configmaps(dev_cluster: DevCluster) -> None:
    await dev_cluster.create("pods", kai_pod("init", inits=("setup",), **{"gpu-fraction": "0.5", "gpu-fraction-container-name": "setup"}))
    pod = await bound(dev_cluster, "init")
    prefix = pod["metadata"]["annotations"][CONFIGMAP_ANNOTATION]
    setup = pod["spec"]["initContainers"][0]
    assert setup["envFrom"] == [{"configMapRef": {"name": f"{prefix}-i0-evar", "optional": False}}]
    assert (await capabilities(dev_cluster, pod, "i0"))["data"][LIMIT_ENV] == "7680m"
    evar = await dev_cluster.get("configmaps", "default", f"{prefix}-i0-evar")
    assert "data" not in evar and evar["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    assert "env" not in pod["spec"]["containers"][0]


async def test_with_hamicore_off_no_limit_is_asked_for_or_written(dev_cluster: DevCluster) -> None:
    assert dev_cluster.scheduler is not None
    dev_cluster.kai_admission.options = dev_cluster.scheduler.options = KaiOptions(hamicore=False)
    created = await dev_cluster.create("pods", kai_pod("no-hamicore", **{"gpu-memory": "4096"}))
    assert LIMIT_ENV not in [e["name"] for e in created["spec"]["containers"][0]["env"]]
    data = (await capabilities(dev_cluster, await bound(dev_cluster, "no-hamicore")))["data"]
    assert LIMIT_ENV not in data and data["GPU_PORTION"] == "0.27"


async def test_a_gpu_annotation_under_the_default_scheduler_is_not_kais(dev_cluster: DevCluster) -> None:
    created = await dev_cluster.create("pods", kai_pod("elsewhere", scheduler=None, **{"gpu-memory": "4096"}))
    assert CONFIGMAP_ANNOTATION not in created["metadata"]["annotations"] and "env" not in created["spec"]["containers"][0]
    pod = await bound(dev_cluster, "elsewhere")  # the default scheduler's stand-in places it by its nodeSelector
    assert GPU_GROUP_LABEL not in (pod["metadata"].get("labels") or {})
    assert not [c for c in await dev_cluster.list("configmaps", "default") if c["metadata"]["name"].startswith("elsewhere")]
