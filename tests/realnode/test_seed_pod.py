"""The seed's pod on the real node, with our webhook, node agent, watcher and verifier running as local processes
at their shipped defaults (the node's /usr/local/vgpu and /var/lib/kai-isolator are its own, in the work dir)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_isolator.services.devcluster.fake_gpu_ledger import FAKE_CONTEXT_OVERHEAD_BYTES
from kai_isolator.shared.contract import DEFAULT_VGPU_MOUNT, INJECT_ANNOTATION, PRELOAD_PATH, VGPU_VOLUME
from support.pods import cuda_pod
from support.real_node import SEED_POD, Node, isolated
from support.waiting import until

VENV_BIN = Path(sys.executable).parent  # kubectl finds the kubectl-isolator plugin on PATH
ISOLATED = "kai-resource-isolator.io/Isolated"


@pytest.fixture(scope="module")
def isolated_node(real_node_session: Node, cuda_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with isolated(real_node_session, tmp_path_factory.mktemp("isolation")):
        yield real_node_session


def test_the_seeds_pod_runs_isolated_in_runc(isolated_node: Node) -> None:
    node = isolated_node
    node.kubectl("apply", "-f", "-", input_text=SEED_POD)
    node.made.append(("default", "gpu-sharing-with-isolation"))
    try:
        pod = node.wait_running("gpu-sharing-with-isolation", timeout_s=120)
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        smi = node.kubectl("exec", "gpu-sharing-with-isolation", "--", "nvidia-smi")
        print(f"\nkubectl exec gpu-sharing-with-isolation -- nvidia-smi\n{smi}")
        assert re.search(r"\| +\d+MiB / +4147MiB \|", smi) and "15360MiB" not in smi, smi
        maps = node.kubectl("exec", "gpu-sharing-with-isolation", "--", "cat", "/proc/1/maps")
        assert "/usr/local/vgpu/" in maps and "libvgpu.so" in maps, maps
        probe = node.kubectl("exec", "gpu-sharing-with-isolation", "--", "cuprobe", "init", "ctx", "0",
                             "alloc", str(4100 << 20), "alloc", str(100 << 20))
        assert [line.split()[2] for line in probe.splitlines()[-2:]] == ["rc=0", "rc=2"], probe  # 2: CUDA_ERROR_OUT_OF_MEMORY

        def isolated() -> bool:
            conditions = node.pod("gpu-sharing-with-isolation")["status"].get("conditions", [])
            return any(c["type"] == ISOLATED and c["status"] == "True" for c in conditions)

        until("the pod's Isolated condition is True", isolated, 90)
        env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "KUBECONFIG": str(node.plane.admin_kubeconfig)}

        def verified() -> str:
            done = subprocess.run([str(node.plane.binaries.kubectl), "isolator", "status"], capture_output=True, text=True, env=env, timeout=30)
            return done.stdout if "verified" in done.stdout else ""

        status = until("kubectl isolator status says verified", verified, 60)
        print(status)
    finally:
        print(json.dumps(node.pod("gpu-sharing-with-isolation")["status"].get("conditions"), indent=1))


def test_a_raw_driver_escape_is_killed_from_runcs_cgroups_and_the_neighbour_keeps_its_memory(isolated_node: Node, cuda_image: str) -> None:
    node = isolated_node
    # The neighbour holds 1 GiB through the library, within its 2048 MiB; the attacker shares the fake GPU.
    node.apply_pod(cuda_pod("neighbour", cuda_image, 2048, ["cuprobe", "init", "ctx", "0", "alloc", str(1 << 30), "hold", "3600000"], pull_policy="Never"))
    node.apply_pod(cuda_pod("attacker", cuda_image, 1024, ["sleep", "infinity"], pull_policy="Never"))
    node.wait_running("neighbour", timeout_s=120)
    node.wait_running("attacker", timeout_s=120)
    until("the neighbour holds its 1 GiB", lambda: "holding" in node.kubectl("logs", "neighbour"), 30)
    # rawelf finds the driver's cuMemAlloc_v2 by a raw ELF lookup: the library never sees the 3 GiB.
    attack = node.plane.kubectl("exec", "attacker", "--", "rawelf", str(3 << 30), "30000", check=False, timeout_s=60)
    assert "alloc 3221225472 rc=0" in attack.stdout, attack
    assert attack.returncode == 137, attack  # SIGKILLed by the enforcer, not ended by itself
    assert "holding" in node.kubectl("logs", "neighbour")
    neighbour = node.pod("neighbour")["status"]["containerStatuses"][0]
    assert neighbour["restartCount"] == 0 and "running" in neighbour["state"], neighbour
    # The driver's view: the neighbour's 1 GiB is all that is left on the GPU.
    gpu = node.real.gpu
    assert gpu is not None
    smi = subprocess.run([str(gpu.driver / "nvidia-smi")], env={"LD_LIBRARY_PATH": str(gpu.driver)},
                         capture_output=True, text=True, timeout=30)
    held_mib = 1024 + FAKE_CONTEXT_OVERHEAD_BYTES // (1 << 20)  # its 1 GiB and its context, as NVML charges it
    assert re.search(rf"\| +{held_mib}MiB / +15360MiB \|", smi.stdout), smi


def test_upstreams_kind_smoke_checks_on_the_real_node(isolated_node: Node, cuda_image: str) -> None:
    """The upstream isolator's kind smoke test, on our webhook and node agent: the library and ld.so.preload on the node,
    the injected pod Ready as uid 1000 with the library mapped, a plain pod and an opted-out pod untouched."""
    node = isolated_node
    preload = node.real.node.host_path(DEFAULT_VGPU_MOUNT) / "ld.so.preload"  # type: ignore[union-attr]
    until("the node agent installed the library", preload.is_file, 60)
    named = Path(preload.read_text().split()[0])
    assert named.name == "libvgpu.so" and str(named).startswith(f"{DEFAULT_VGPU_MOUNT}/")
    assert node.real.node.host_path(str(named)).is_file()  # type: ignore[union-attr]

    injected = cuda_pod("as-user", cuda_image, 2048, ["sleep", "infinity"], pull_policy="Never")
    injected["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True}
    plain = {**cuda_pod("plain", cuda_image, 0, ["sleep", "infinity"], pull_policy="Never"), "metadata": {"name": "plain", "namespace": "default"}}
    plain["spec"].pop("schedulerName")
    opted_out = cuda_pod("opted-out", cuda_image, 2048, ["sleep", "infinity"], pull_policy="Never")
    opted_out["metadata"]["annotations"][INJECT_ANNOTATION] = "false"
    for pod in (injected, plain, opted_out):
        node.apply_pod(pod)
    for name in ("as-user", "plain", "opted-out"):
        node.wait_running(name, timeout_s=120)

    pod = node.pod("as-user")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert any(v["name"] == VGPU_VOLUME and v["hostPath"]["path"] == DEFAULT_VGPU_MOUNT for v in pod["spec"]["volumes"])
    mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[PRELOAD_PATH]["readOnly"] and mounts[DEFAULT_VGPU_MOUNT]["readOnly"]
    assert node.kubectl("exec", "as-user", "--", "id", "-u").strip() == "1000"
    assert f"{DEFAULT_VGPU_MOUNT}/" in node.kubectl("exec", "as-user", "--", "cat", "/proc/1/maps")
    for name in ("plain", "opted-out"):
        spec = node.pod(name)["spec"]
        assert not any(v["name"] == VGPU_VOLUME for v in spec.get("volumes", [])), spec
        assert "libvgpu.so" not in node.kubectl("exec", name, "--", "cat", "/proc/1/maps")


def test_a_pod_that_lands_before_the_library_waits_for_it_and_starts_with_it(isolated_node: Node, cuda_image: str) -> None:
    """The webhook mounts the library directory as a hostPath of type Directory: on a node where the agent has not
    installed it yet (a new node, the DaemonSet pod not up), the real kubelet refuses to start the container, and
    retries until the directory is there; the pod never runs without the library."""
    node = isolated_node
    library = node.node.host_path(DEFAULT_VGPU_MOUNT)
    until("the node agent installed the library", (library / "ld.so.preload").is_file, 60)
    aside = library.with_name(library.name + ".aside")
    library.rename(aside)  # the node as it is before the agent's first install
    try:
        node.apply_pod(cuda_pod("early", cuda_image, 2048, ["sleep", "infinity"], pull_policy="Never"))

        def refused() -> str:
            events = json.loads(node.kubectl("get", "events", "--field-selector", "involvedObject.name=early", "-o", "json"))["items"]
            return next((e["message"] for e in events if e.get("reason") == "FailedMount"), "")

        message = until("the kubelet refuses the missing library directory", refused, 60)
        assert "hostPath type check failed" in message and DEFAULT_VGPU_MOUNT in message, message
        assert node.pod("early")["status"].get("phase") == "Pending"
    finally:
        aside.rename(library)  # what the agent's install does
    node.wait_running("early", timeout_s=150)  # the kubelet's mount retries back off to at most about 2 min
    assert f"{DEFAULT_VGPU_MOUNT}/" in node.kubectl("exec", "early", "--", "cat", "/proc/1/maps")
