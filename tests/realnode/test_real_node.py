"""The real node itself: registered and Ready with the fake GPU, pods in runc containers under the node's cgroup,
hostPath and read-only subPath mounts as the webhook injects them, and the `nvidia` runtime adding the driver."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from support.real_node import HAMI_BUILD, Node

GPU_LABELS = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.memory": "15360", "nvidia.com/gpu.product": "Tesla-T4"}


def library_dir(where: Path) -> Path:
    """A node folder as the node agent leaves it: libvgpu.so and an ld.so.preload naming it (by its node path, which
    the webhook mounts at the same path in the container)."""
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy2(HAMI_BUILD / "libvgpu.so", where / "libvgpu.so")
    (where / "ld.so.preload").write_text(f"{where / 'libvgpu.so'}\n")
    return where


def preloaded_pod(name: str, image: str, lib: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True},
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Never", "command": ["sleep", "infinity"],
                "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                "volumeMounts": [{"name": "vgpu", "mountPath": str(lib), "readOnly": True},
                                 {"name": "vgpu", "mountPath": "/etc/ld.so.preload", "subPath": "ld.so.preload", "readOnly": True}],
            }],
            "volumes": [{"name": "vgpu", "hostPath": {"path": str(lib), "type": "Directory"}}],
        },
    }


def test_the_node_registers_ready_with_the_fake_gpu(real_node: Node) -> None:
    node = json.loads(real_node.kubectl("get", "node", "gpu-node-1", "-o", "json"))
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["Ready"] == "True", node["status"]["conditions"]
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    assert GPU_LABELS.items() <= node["metadata"]["labels"].items()
    assert {"type": "InternalIP", "address": real_node.node.addresses.node_ip} in node["status"]["addresses"]
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.4.")
    assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("v1.37.")
    assert json.loads(real_node.kubectl("get", "runtimeclass", "nvidia", "-o", "json"))["handler"] == "nvidia"


def test_a_pod_runs_in_runc_with_the_library_preloaded_from_a_hostpath(real_node: Node, cuda_image: str, tmp_path: Path) -> None:
    lib = library_dir(tmp_path / "vgpu")
    real_node.apply_pod(preloaded_pod("preloaded", cuda_image, lib, {"NVIDIA_VISIBLE_DEVICES": "void"}))
    pod = real_node.wait_running("preloaded")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0

    maps = real_node.kubectl("exec", "preloaded", "--", "cat", "/proc/1/maps")
    assert f"{lib}/libvgpu.so" in maps
    assert real_node.kubectl("exec", "preloaded", "--", "cat", "/etc/ld.so.preload").strip() == f"{lib}/libvgpu.so"
    assert real_node.kubectl("exec", "preloaded", "--", "id", "-u").strip() == "1000"
    # Read-only from inside, as mounted; and the container is runc's, in the node's cgroup, not the machine's.
    denied = real_node.plane.kubectl("exec", "preloaded", "--", "sh", "-c", "echo x > /etc/ld.so.preload", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied
    cgroups = real_node.kubectl("exec", "preloaded", "--", "cat", "/proc/1/cgroup")
    assert f"/{real_node.node.cgroup.name}/kubepods/" in cgroups, cgroups
    listed = real_node.node.exec("runc", "--root", "/run/containerd/runc/k8s.io", "list", "--format", "json")
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    assert listed.returncode == 0 and any(c["id"] == container_id and c["status"] == "running" for c in json.loads(listed.stdout)), listed
    # NVIDIA_VISIBLE_DEVICES=void: the nvidia runtime (the node's default) adds no driver.
    present = "test -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 || test -e /usr/bin/nvidia-smi && echo present || echo absent"
    assert real_node.kubectl("exec", "preloaded", "--", "sh", "-c", present).strip() == "absent"


def test_the_nvidia_runtime_adds_the_driver_where_gpus_are_named(real_node: Node, cuda_image: str) -> None:
    # No library here: the whole fake T4, as the driver shows it (the library, without the node agent's grant, would
    # fail closed; the seed pod's test has both).
    pod = preloaded_pod("with-gpu", cuda_image, Path("/unused"), {"NVIDIA_VISIBLE_DEVICES": "GPU-0000fa4e-1111-2222-3333-000000000000"})
    pod["spec"]["containers"][0].pop("volumeMounts")
    pod["spec"].pop("volumes")
    real_node.apply_pod(pod)
    real_node.wait_running("with-gpu")
    smi = real_node.kubectl("exec", "with-gpu", "--", "nvidia-smi")
    assert re.search(r"\| +\d+MiB / +15360MiB \|", smi), smi
    probe = real_node.kubectl("exec", "with-gpu", "--", "cuprobe", "init", "ctx", "0", "alloc", str(1 << 30), "info")
    assert "alloc 1073741824 rc=0" in probe, probe
    mounts = real_node.kubectl("exec", "with-gpu", "--", "cat", "/proc/self/mounts")
    assert " /usr/lib/x86_64-linux-gnu/libcuda.so.1 " in mounts and " /usr/bin/nvidia-smi " in mounts, mounts
