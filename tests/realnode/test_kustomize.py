"""The manifests applied on the real node as users apply them (`kubectl apply -k` of the dev overlay, its images pinned
to the published release by digest as a user pins them with kustomize, pulled from the node's registry): every component
comes up in runc containers, the certs Job completes, and a GPU-sharing pod runs with the library mapped."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kai_isolator.services.devcluster.plane import ControlPlaneError
from kai_isolator.shared.contract import DEFAULT_VGPU_MOUNT
from support.pods import cuda_pod
from support.real_node import DEV_OVERLAY, NAMESPACE, Node, nats_volume, pod_logs, published, workloads
from support.waiting import until

pytestmark = pytest.mark.timeout(600)
NATS_VOLUME = "kai-isolator-kustomize-nats"


@pytest.fixture(autouse=True)
def _pods_of_each_test_go(real_node: Node) -> None:
    """Through `real_node`: the pods each test applied are deleted after it."""


def pinned_overlay(node: Node, folder: Path) -> Path:
    """A kustomization over the dev overlay naming the published images by digest (`kustomize edit set image
    kai-isolator=docker.io/projecthami/kai-resource-isolator@sha256:...`, as a user pins a release)."""
    release = published(node)
    pins = {"kai-isolator": release.images["image"], "kai-isolator-nodeagent": release.images["nodeAgent.image"]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEV_OVERLAY, folder)],  # kustomize takes no absolute paths
        "images": [{"name": name, "newName": image.reference.rsplit(":", 1)[0], "digest": image.digest} for name, image in pins.items()]}))
    return folder


@pytest.fixture(scope="module")
def applied(real_node_session: Node, chart_images: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = real_node_session
    overlay = pinned_overlay(node, tmp_path_factory.mktemp("pinned-overlay"))
    nats_volume(node, NATS_VOLUME)
    started = time.monotonic()
    try:
        node.kubectl("apply", "-k", str(overlay), timeout_s=120)
        # The Job first: the webhook's pods mount the Secret it creates.
        node.kubectl("wait", "--for=condition=complete", "job/kai-resource-isolator-certs", "-n", NAMESPACE, "--timeout=180s", timeout_s=200)
        for name in workloads(node, NAMESPACE):
            node.kubectl("rollout", "status", name, "-n", NAMESPACE, "--timeout=180s", timeout_s=200)
    except (AssertionError, ControlPlaneError) as error:
        pods = node.kubectl("get", "pods,jobs,pvc", "-n", NAMESPACE, "-o", "wide", check=False)
        raise AssertionError(f"{error}\n{pods}\n{pod_logs(node, NAMESPACE)}") from None
    print(f"\nkubectl apply -k to all Ready: {time.monotonic() - started:.1f}s", file=sys.stderr)
    try:
        yield node
    finally:
        node.kubectl("delete", "-k", str(overlay), "--ignore-not-found", "--wait=true", check=False, timeout_s=180)
        node.kubectl("delete", "pv", NATS_VOLUME, "--ignore-not-found", check=False)


def test_every_component_comes_up_on_the_real_node(applied: Node) -> None:
    node = applied
    pinned = {image.by_digest for image in published(node).images.values()}
    pods = json.loads(node.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json"))["items"]
    assert {c["image"] for p in pods for c in p["spec"]["containers"] if "projecthami" in c["image"]} == pinned
    names = set(workloads(node, NAMESPACE))
    expected = {f"deployment.apps/kai-resource-isolator-{c}" for c in ("webhook", "watcher", "verifier")}
    assert expected | {"daemonset.apps/kai-resource-isolator-nodeagent", "statefulset.apps/nats"} <= names, names
    pods = json.loads(node.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json"))["items"]
    serving = [p for p in pods if p["status"]["phase"] != "Succeeded"]  # the certs Job's pod stays, completed
    assert len(serving) == len(pods) - 1
    for pod in serving:
        assert pod["spec"]["nodeName"] == "gpu-node-1" and pod["status"]["phase"] == "Running", pod["status"]
        assert all(s["ready"] for s in pod["status"]["containerStatuses"]), pod["status"]["containerStatuses"]
    webhook = json.loads(node.kubectl("get", "mutatingwebhookconfiguration", "kai-resource-isolator-mutating", "-o", "json"))
    assert webhook["webhooks"][0]["clientConfig"].get("caBundle")


def test_a_gpu_sharing_pod_runs_with_the_library(applied: Node, cuda_image: str) -> None:
    node = applied
    preload = node.node.host_path(DEFAULT_VGPU_MOUNT) / "ld.so.preload"
    until("the node agent installed the library", preload.is_file, 60)
    node.apply_pod(cuda_pod("under-kustomize", cuda_image, 2048, ["sleep", "infinity"]))
    pod = node.wait_running("under-kustomize", timeout_s=120)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert f"{DEFAULT_VGPU_MOUNT}/libvgpu.so." in node.kubectl("exec", "under-kustomize", "--", "cat", "/proc/1/maps")
