"""The seed's walkthrough on the real node with the real KAI-Scheduler in place of the simulation: KAI's admission,
podgrouper, scheduler and binder (built from its source archive, run with the flags its operator gives them for the
seed's `--set global.gpuSharing=true --set binder.plugins.hamicore.enabled=true`), its GPU reservation pod running for
real in runc (KAI's `resourcereservation` program asks the node's fake NVML for its one GPU and writes the UUID on its
pod), our chart installed with `helm install`, and the seed's pod through `kubectl apply`.

KAI's operator is not run: it would deploy each component from images of its own, which this machine would have to
build and run as pods; its components run here as processes with the arguments it would give them (tests/kai/real_kai.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kai_isolator.services.devcluster.build import _unpack, ensure_kai, kai_source
from kai_isolator.services.devcluster.kai import CONFIGMAP_ANNOTATION, fake_gpu_uuid
from kai_isolator.services.devcluster.oci import image_archive, with_libraries
from kai_isolator.services.nodeagent.grant_files import read_grant
from kai_isolator.shared.contract import DEFAULT_GRANT_DIR
from deploy.deploy_tools import helm_binary
from kai.real_kai import (
    RESERVATION_IMAGE, RESERVATION_NAMESPACE, GPU_INDEX_ANNOTATION, TENANT, RealKaiScheduling, ensure_namespace, real_admission,
)
from support.pods import cuda_pod
from support.real_node import SEED_POD, SEED_POD_NAME, Node, chart_release, is_running
from support.waiting import until

pytestmark = pytest.mark.timeout(900)  # the first run builds KAI's resourcereservation (minutes)
KAI_CHART = Path("deployments") / "kai-scheduler"
SEED_KAI_VALUES = ("global.gpuSharing=true", "binder.plugins.hamicore.enabled=true")
# What KAI's chart installs for the reservation pods beside the operator: the role that lets them patch their own pod.
RESERVATION_TEMPLATES = ("templates/rbac/resourcereservation.yaml", "templates/rbac/resourcereservation-binding.yaml")
LIMIT_KEY = "CUDA_DEVICE_MEMORY_LIMIT"


def reservation_image(node: Node, workdir: Path) -> float:
    """KAI's `resourcereservation` program as the image the binder names, imported into the node's containerd; the
    driver's NVML is left out, as in KAI's image: the `nvidia` runtime adds it. Seconds it took."""
    started = time.monotonic()
    binary = ensure_kai(("resourcereservation",)) / "resourcereservation"
    program = "/usr/local/bin/resourcereservation"
    files = with_libraries({program: binary}, provided=("libnvidia-ml.so.1",))
    # containerd's name for the binder's unqualified reference: docker.io/ is implied.
    archive = image_archive(f"docker.io/{RESERVATION_IMAGE}", files, workdir / "resourcereservation.tar", entrypoint=[program])
    node.node.import_image(archive)
    return time.monotonic() - started


def chart_manifests(source: Path, templates: tuple[str, ...]) -> str:
    """Some of KAI's chart's objects, rendered by helm from the chart with the seed's values."""
    argv = [str(helm_binary()), "template", "kai-scheduler", str(source / KAI_CHART), "-n", "kai-scheduler"]
    argv += [flag for value in SEED_KAI_VALUES for flag in ("--set", value)]
    argv += [flag for template in templates for flag in ("--show-only", template)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def clear_reservations(node: Node) -> None:
    node.kubectl("delete", "pods", "--all", "-n", RESERVATION_NAMESPACE, "--grace-period=0", "--force", "--ignore-not-found", check=False, timeout_s=60)


def reservation_pods(node: Node) -> list[dict[str, Any]]:
    return json.loads(node.kubectl("get", "pods", "-n", RESERVATION_NAMESPACE, "-o", "json"))["items"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def real_kai(real_node_session: Node, chart_images: None, cuda_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """The session's real node with the real KAI and our chart; the simulated KAI is back after the module."""
    node = real_node_session
    cluster = node.real.cluster
    assert cluster is not None
    workdir = tmp_path_factory.mktemp("real-kai")
    took = {"reservation image": reservation_image(node, workdir)}
    source = _unpack(kai_source(), workdir / "source")
    node.loop.run(cluster.stop_simulated_kai(), 60)
    # The simulation's reservation pods go with it: the real KAI would take each for a GPU group of its own.
    clear_reservations(node)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: node.loop.run(cluster.start_simulated_kai(), 60))
        started = time.monotonic()
        scheduling = RealKaiScheduling(node.plane, workdir, source)
        scheduling.install(["default"])
        node.kubectl("apply", "-f", "-", input_text=chart_manifests(source, RESERVATION_TEMPLATES))
        stack.callback(scheduling.stop)
        scheduling.start(simulate_reservations=False)
        ensure_namespace(node.plane, TENANT)  # where real_admission's probes go
        (workdir / "admission").mkdir()
        stack.enter_context(contextlib.contextmanager(real_admission)(node.plane, workdir / "admission", True))
        took["KAI started"] = time.monotonic() - started
        took["helm install (ours)"] = stack.enter_context(chart_release(node, "kai-isolator-kai-nats"))
        stack.callback(lambda: clear_reservations(node))
        print("\nreal KAI on the real node: " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items()), file=sys.stderr)
        try:
            yield node
        finally:
            node.clean()
            scheduling.check_alive()


def kai_configmap(node: Node, pod: dict[str, Any], index: int = 0) -> dict[str, str]:
    """The data of the ConfigMap KAI's binder wrote for `pod`'s fraction container: `<runai/shared-gpu-configmap>-<index>`,
    which the container's GPU_PORTION, CUDA_DEVICE_MEMORY_LIMIT and NVIDIA_VISIBLE_DEVICES refer to."""
    name = f"{pod['metadata']['annotations'][CONFIGMAP_ANNOTATION]}-{index}"
    return json.loads(node.kubectl("get", "configmap", name, "-o", "json")).get("data") or {}  # type: ignore[no-any-return]


def running_bound_once(node: Node, manifest: str, name: str, attempts: int = 3) -> dict[str, Any]:
    """The pod from `manifest` Running, bound on KAI's first try. Under load KAI's binder can fail a first bind (its
    cache has not yet seen the ConfigMap it just made) and roll it back; its retry then deletes the GPU group's
    reservation pod and binds the pod without one (L20). That race is KAI's, not what these tests compare: such a pod
    is made again, after its reservation pods are gone."""
    for _ in range(attempts):
        node.kubectl("apply", "-f", "-", input_text=manifest)
        pod = node.wait_running(name, timeout_s=180)
        if not rolled_back(node, pod):
            return pod
        node.kubectl("delete", "pod", name, "--grace-period=0", "--force", "--ignore-not-found", check=False, timeout_s=60)
        clear_reservations(node)
    pytest.fail(f"KAI's binder rolled back every one of {attempts} binds of {name}")


def rolled_back(node: Node, pod: dict[str, Any]) -> bool:
    selector = f"involvedObject.uid={pod['metadata']['uid']},reason=BindingError"
    return bool(json.loads(node.kubectl("get", "events", "-n", pod["metadata"]["namespace"], "--field-selector", selector, "-o", "json"))["items"])


def test_the_seed_on_the_real_kai(real_kai: Node) -> None:
    node = real_kai
    node.made.append(("default", SEED_POD_NAME))
    pod = running_bound_once(node, SEED_POD, SEED_POD_NAME)

    # KAI's reservation pod ran for real: its container asked NVML for its GPU and wrote the UUID on itself.
    reservations = [p for p in reservation_pods(node) if p["status"].get("phase") == "Running"]
    assert len(reservations) == 1, [p["status"] for p in reservation_pods(node)]
    assert reservations[0]["metadata"]["annotations"][GPU_INDEX_ANNOTATION] == fake_gpu_uuid(0)
    assert reservations[0]["spec"]["containers"][0]["image"] == RESERVATION_IMAGE

    data = kai_configmap(node, pod)
    print(f"\nKAI's ConfigMap for {SEED_POD_NAME}: {json.dumps(data)}")
    assert data.get(LIMIT_KEY) == "4147m" and data.get("GPU_PORTION") == "0.27", data
    grant = until("the node agent's grant", lambda: read_grant(node.node.host_path(DEFAULT_GRANT_DIR), pod["metadata"]["uid"], "cuda"), 60)
    assert [(d.uuid, d.limit_bytes) for d in grant.devices] == [(fake_gpu_uuid(0), 4147 << 20)], grant

    smi = node.kubectl("exec", SEED_POD_NAME, "--", "nvidia-smi")
    print(f"kubectl exec {SEED_POD_NAME} -- nvidia-smi\n{smi}")
    assert re.search(r"\| +\d+MiB / +4147MiB \|", smi) and "15360MiB" not in smi, smi
    # Our webhook and KAI's both reached the pod, in the API server's order, and our policy let KAI's envFrom be.
    assert "/usr/local/vgpu/" in node.kubectl("exec", SEED_POD_NAME, "--", "cat", "/proc/1/maps")



def test_three_seed_shares_run_on_the_t4_and_the_fourth_stays_pending(real_kai: Node, cuda_image: str) -> None:
    """KAI's capacity on the real node: 4096 MiB of the 15360 MiB T4 is planned as 0.27, so three run and the fourth
    waits, until one of the three goes. Each running share holds its own grant, on the one GPU KAI reserved."""
    node = real_kai
    node.clean()  # the seed's pod, if the test before left it
    names = [f"share-{i}" for i in range(4)]
    for name in names:
        node.apply_pod(cuda_pod(name, cuda_image, 4096, ["sleep", "infinity"]))
    # Which three: KAI does not promise creation order (loaded run: the podgrouper made share-2's group after
    # share-3's, so share-3 took the third place and share-2 waited), only that three fit and the fourth does not.
    try:
        running = until("three of the four shares running", lambda: three_running(node, names), 180)
    except AssertionError as error:
        raise AssertionError(f"{error}: {shares_state(node, names)}") from None
    time.sleep(5)  # several of KAI's scheduling cycles (one a second)
    [fourth_name] = set(names) - {pod["metadata"]["name"] for pod in running}
    fourth = node.pod(fourth_name)
    assert not fourth["spec"].get("nodeName") and fourth["status"].get("phase") == "Pending", (fourth_name, fourth["status"])
    reservations = [p for p in reservation_pods(node) if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    assert [p["metadata"]["annotations"][GPU_INDEX_ANNOTATION] for p in reservations] == [fake_gpu_uuid(0)], reservations
    root = node.node.host_path(DEFAULT_GRANT_DIR)
    for pod in running:
        grant = until("the node agent's grant", lambda pod=pod: read_grant(root, pod["metadata"]["uid"], "cuda"), 60)
        assert [(d.uuid, d.limit_bytes) for d in grant.devices] == [(fake_gpu_uuid(0), 4147 << 20)], grant
    node.kubectl("delete", "pod", running[0]["metadata"]["name"], "--grace-period=0", "--force", "--wait=true", timeout_s=60)
    node.wait_running(fourth_name, timeout_s=120)


def three_running(node: Node, names: list[str]) -> list[dict[str, Any]] | None:
    running = [pod for pod in (node.pod(name) for name in names) if is_running(pod)]
    return running if len(running) == 3 else None


def shares_state(node: Node, names: list[str]) -> str:
    """Each share's phase and node, and the scheduler's word on it, for a failure to say where KAI left them."""
    pods = [node.pod(name) for name in names]
    return "; ".join(f"{pod['metadata']['name']} {pod['status'].get('phase')} on {pod['spec'].get('nodeName') or '-'}"
                     f" {[c.get('message') for c in pod['status'].get('conditions', []) if c.get('status') == 'False']}" for pod in pods)
