"""The local control plane: what it simulates (KAI's admission, scheduler and binder; GPU nodes' kubelets) behaves as
the real parts do, through the real kube-apiserver, and `kai-isolator devcluster` starts and stops cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kai_isolator.services.devcluster.build import ensure_all
from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.kai import CONFIGMAP_ANNOTATION, LIMIT_ENV, fake_gpu_uuid
from kai_isolator.services.devcluster.kubelet import EXIT_CODE_ANNOTATION, RUN_SECONDS_ANNOTATION
from kai_isolator.services.devcluster.plane import ApiCallError
from support.pods import Obj, gpu_pod
from support.waiting import eventually

BIN = Path(sys.executable).parent


async def phase(cluster: DevCluster, name: str, wanted: str) -> Obj | None:
    async def check() -> Obj | None:
        pod = await cluster.get("pods", "default", name)
        return pod if pod["status"].get("phase") == wanted else None
    return await eventually(check, 20, every_s=0.05, fail=False)  # type: ignore[no-any-return]


async def test_kubectl_create_gets_kai_admission_then_binding_then_running(dev_cluster: DevCluster, tmp_path: Path) -> None:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(json.dumps(gpu_pod("seed")))
    assert dev_cluster.plane is not None
    # Default validation, protobuf: as users run it. In a thread: KAI's admission is served from this event loop.
    await asyncio.to_thread(dev_cluster.plane.kubectl, "create", "-f", str(manifest))
    running = await phase(dev_cluster, "seed", "Running")
    assert running is not None and running["spec"]["nodeName"] == "gpu-node-1"
    env = {e["name"]: e for e in running["spec"]["containers"][0]["env"]}
    reference = env[LIMIT_ENV]["valueFrom"]["configMapKeyRef"]
    assert reference["name"] == running["metadata"]["annotations"][CONFIGMAP_ANNOTATION] + "-0"
    configmap = await dev_cluster.get("configmaps", "default", reference["name"])
    # The seed's arithmetic: 4096 MiB of a 15360 MiB card is portion 0.27, and int(15360 x 0.27) MiB.
    assert configmap["data"] == {LIMIT_ENV: "4147m", "GPU_PORTION": "0.27", "RUNAI_NUM_OF_GPUS": "0.27", "NVIDIA_VISIBLE_DEVICES": fake_gpu_uuid(0)}
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == running["metadata"]["uid"]
    statuses = running["status"]["containerStatuses"]
    assert statuses[0]["containerID"].startswith("containerd://") and statuses[0]["state"]["running"]


async def test_kai_admission_refuses_a_pod_whose_fraction_container_is_missing(dev_cluster: DevCluster) -> None:
    with pytest.raises(ApiCallError) as refused:
        await dev_cluster.create("pods", gpu_pod("no-target", annotations={"gpu-fraction-container-name": "sidecar"}))
    # controller-runtime's Denied (403) with the gpusharing plugin's message, as the real KAI answers (tests/kai).
    assert refused.value.code == 403 and "container with name sidecar not found for fraction request" in str(refused.value)


async def test_plain_pods_meet_neither_kai_nor_a_scheduler(dev_cluster: DevCluster) -> None:
    plain = await dev_cluster.create("pods", {"metadata": {"name": "plain"}, "spec": {"containers": [{"name": "main", "image": "busybox"}]}})
    assert "env" not in plain["spec"]["containers"][0] and CONFIGMAP_ANNOTATION not in (plain["metadata"].get("annotations") or {})
    await asyncio.sleep(0.5)  # far past the simulated scheduling step: still unbound, as with no scheduler for it
    assert not (await dev_cluster.get("pods", "default", "plain"))["spec"].get("nodeName")


async def test_pods_end_by_annotation_and_a_graceful_delete_is_confirmed_by_the_node(dev_cluster: DevCluster) -> None:
    await dev_cluster.create("pods", gpu_pod("short", annotations={RUN_SECONDS_ANNOTATION: "0.2", EXIT_CODE_ANNOTATION: "3"}))
    failed = await phase(dev_cluster, "short", "Failed")
    assert failed is not None and failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    await dev_cluster.create("pods", gpu_pod("long"))
    assert await phase(dev_cluster, "long", "Running")
    await dev_cluster.delete("pods", "default", "long")  # the default 30 s grace: only the node ends it sooner

    await dev_cluster.wait_gone("pods", "default", "long")


async def test_a_kubelet_may_write_only_its_own_pods(dev_cluster: DevCluster) -> None:
    await dev_cluster.add_node("gpu-node-2", 40960)
    await dev_cluster.create("pods", gpu_pod("elsewhere", node="gpu-node-2"))
    running = await phase(dev_cluster, "elsewhere", "Running")
    assert running is not None and running["spec"]["nodeName"] == "gpu-node-2"
    limit = await dev_cluster.get("configmaps", "default", running["metadata"]["annotations"][CONFIGMAP_ANNOTATION] + "-0")
    assert limit["data"][LIMIT_ENV] == "4505m"  # KAI rounds 4096 / 40900 up to 0.11 of the card: int(40960 x 0.11)
    with pytest.raises(ApiCallError) as forbidden:  # the Node authorizer: node 1 has no business with node 2's pod
        await dev_cluster.kubelets["gpu-node-1"].api.request("PATCH", "/api/v1/namespaces/default/pods/elsewhere/status",
                                                              {"status": {"phase": "Failed"}},
                                                              content_type="application/strategic-merge-patch+json")
    assert forbidden.value.code == 403


async def test_a_restarted_api_server_and_a_compacted_history_do_not_stop_the_simulation(dev_cluster: DevCluster) -> None:
    await dev_cluster.restart_apiserver()
    await dev_cluster.compact()
    await dev_cluster.create("pods", gpu_pod("after-restart"))
    assert await phase(dev_cluster, "after-restart", "Running")


@pytest.mark.timeout(90)
def test_the_command_serves_kubectl_and_leaves_nothing_running(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig.yaml"
    command = subprocess.Popen([str(BIN / "kai-isolator"), "devcluster", "--kubeconfig", str(kubeconfig), "--workdir", str(tmp_path / "work"),
                                "--gpu-node", "node-a:24576"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert command.stdout is not None
        banner = next(line for line in command.stdout if "Ctrl-C" in line)
        assert "kube-apiserver at https://127.0.0.1:" in banner and str(kubeconfig) in banner, banner
        nodes = subprocess.run([str(ensure_all().kubectl), "get", "nodes", "-o", "name"], env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                               capture_output=True, text=True, timeout=30)
        assert nodes.stdout.split() == ["node/node-a"], nodes.stderr
    finally:
        command.send_signal(signal.SIGTERM)
        command.wait(timeout=30)
    assert command.returncode == 0
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_names(p, str(tmp_path / "work"))]
    assert not leftovers, "etcd or kube-apiserver outlived the command"


def _cmdline_names(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
