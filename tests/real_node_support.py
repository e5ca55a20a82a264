"""What the real-node tests share: the node and its cluster as a test drives them (kubectl), and the loop they run on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from deploy.deploy_tools import helm_binary
from kai_isolator.services.devcluster import images
from kai_isolator.services.devcluster.images import docker_env
from kai_isolator.services.devcluster.oci import docker_archive
from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.services.devcluster.realcluster import RealNodeCluster
from kai_isolator.services.devcluster.realnode import RealNode

HAMI_BUILD = Path(__file__).resolve().parents[1] / "hami-core" / "build"
CUDA_IMAGE = "docker.io/nvidia/cuda:12.9.2-base-ubuntu24.04"


class LoopThread:
    """An event loop of its own in a daemon thread: the cluster's webhooks and informers run there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="real-node-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Any, timeout_s: float) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Node:
    """The running real node and its cluster, for tests: kubectl as the admin, the node's own view, its phases."""

    real: RealNodeCluster
    loop: LoopThread
    made: list[tuple[str, str]] = field(default_factory=list)

    @property
    def plane(self) -> ControlPlane:
        assert self.real.cluster is not None and self.real.cluster.plane is not None
        return self.real.cluster.plane

    @property
    def node(self) -> RealNode:
        assert self.real.node is not None
        return self.real.node

    def kubectl(self, *args: str, input_text: str | None = None, check: bool = True, timeout_s: float = 60) -> str:
        return self.plane.kubectl(*args, input_text=input_text, check=check, timeout_s=timeout_s).stdout

    def apply_pod(self, pod: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
        self.made.append((pod["metadata"].get("namespace", "default"), pod["metadata"]["name"]))

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return json.loads(self.kubectl("get", "pod", name, "-n", namespace, "-o", "json"))  # type: ignore[no-any-return]

    def wait_running(self, name: str, namespace: str = "default", timeout_s: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            pod = self.pod(name, namespace)
            if is_running(pod):
                return pod
            if pod["status"].get("phase") in ("Failed", "Succeeded") or time.monotonic() > deadline:
                events = self.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}", check=False)
                raise AssertionError(f"pod {namespace}/{name} not running: {json.dumps(pod['status'], indent=1)}\n{events}")
            time.sleep(0.2)

    def clean(self) -> None:
        for namespace, name in self.made:
            self.kubectl("delete", "pod", name, "-n", namespace, "--ignore-not-found", "--grace-period=0", "--force", "--wait=true",
                         check=False, timeout_s=60)
        self.made.clear()


# --- the chart and the manifests on the real node, installed as users install them ------------------------------

# The seed's example, verbatim but for the image being a local stand-in of that name (no registry is reachable).
SEED_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: gpu-sharing-with-isolation
  annotations:
    gpu-memory: "4096"
spec:
  schedulerName: kai-scheduler
  containers:
  - name: cuda
    image: nvidia/cuda:12.9.2-base-ubuntu24.04
    command: ["sleep", "infinity"]
"""
SEED_POD_NAME = "gpu-sharing-with-isolation"

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "kai-resource-isolator"
DEV_OVERLAY = REPO / "deploy" / "kustomize" / "overlays" / "dev"
RELEASE = NAMESPACE = "kai-resource-isolator"
# What `make images` leaves in the Docker engine: the chart's and the overlay's images, and the NATS stand-in.
CHART_IMAGES = ("kai-isolator:dev", "kai-isolator-nodeagent:dev", "nats:2.10.22-alpine")
# Only image and NATS values: the node's /usr/local and /var/lib are its own (the work dir's), so the chart's host
# paths stay at their defaults.
CHART_VALUES = {"image.registry": "", "image.repository": "kai-isolator", "image.tag": "dev",
                "nodeAgent.image.registry": "", "nodeAgent.image.repository": "kai-isolator-nodeagent", "nodeAgent.image.tag": "dev",
                "nats.enabled": "true"}
NATS_UID = 1000  # the chart's NATS runs as 1000 with fsGroup 1000, which a hostPath volume does not apply


def build_chart_images(log: TextIO) -> None:
    """The chart's images built from this tree, so no test installs an image of older code; Docker's layer cache makes
    an unchanged tree cost seconds (the compose suite has built the same images already in a full run)."""
    kube_builder = images.ensure_prerequisites(log)
    for image in images.PROJECT_IMAGES:
        if image.tag in CHART_IMAGES:
            images.build_image(image, kube_builder, log)


def import_docker_images(node: Node, tags: tuple[str, ...], cache: Path) -> dict[str, float]:
    """The engine's images into the node's containerd, as `kind load docker-image` does; seconds per image."""
    took = {}
    for tag in tags:
        started = time.monotonic()
        node.node.import_image(docker_archive(tag, cache, docker_env()))
        took[tag] = time.monotonic() - started
    return took


def nats_volume(node: Node, name: str) -> None:
    """A 1Gi hostPath PersistentVolume on the node for the NATS StatefulSet's claim: the storage an admin provides
    where no provisioner runs (kind ships one; this cluster has none)."""
    inside = f"/var/lib/{name}"
    folder = node.node.host_path(inside)
    folder.mkdir(parents=True, exist_ok=True)
    os.chown(folder, NATS_UID, NATS_UID)
    node.kubectl("apply", "-f", "-", input_text=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "persistentVolumeReclaimPolicy": "Retain",
                 "hostPath": {"path": inside, "type": "Directory"}}}))


def helm(node: Node, *args: str, timeout_s: float = 300) -> str:
    done = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "KUBECONFIG": str(node.plane.admin_kubeconfig), "HELM_CACHE_HOME": str(node.real.workdir / "helm-cache"),
                               "HELM_CONFIG_HOME": str(node.real.workdir / "helm-config"), "HELM_DATA_HOME": str(node.real.workdir / "helm-data")})
    if done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@contextlib.contextmanager
def chart_release(node: Node, volume: str, install_timeout: str = "300s") -> Iterator[float]:
    """Our chart installed as users install it (`helm install --wait`, only image and NATS values), its images imported
    into the node first; uninstalled afterwards unless a test did. Yields the seconds install took to all Ready."""
    imported = import_docker_images(node, CHART_IMAGES, Path.home() / ".cache" / "kai-isolator" / "node-images")
    print("\nimages imported: " + ", ".join(f"{t} {s:.1f}s" for t, s in imported.items()), file=sys.stderr)
    nats_volume(node, volume)
    started = time.monotonic()
    try:
        helm(node, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
             *[flag for key, value in CHART_VALUES.items() for flag in ("--set", f"{key}={value}")],
             "--wait", "--timeout", install_timeout, timeout_s=360)
    except AssertionError as error:
        pods = node.kubectl("get", "pods,jobs,pvc", "-n", NAMESPACE, "-o", "wide", check=False)
        events = node.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False)
        raise AssertionError(f"{error}\n{pods}\n{events}\n{pod_logs(node, NAMESPACE)}") from None
    took = time.monotonic() - started
    print(f"helm install to all Ready: {took:.1f}s", file=sys.stderr)
    try:
        yield took
    finally:
        if RELEASE in helm(node, "list", "-n", NAMESPACE, "-q"):
            helm(node, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s", timeout_s=180)
        node.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", check=False, timeout_s=120)
        node.kubectl("delete", "pv", volume, "--ignore-not-found", check=False)


def is_running(pod: dict[str, Any]) -> bool:
    """Running with every container ready, as `kubectl wait --for=condition=Ready` would have it."""
    return pod["status"].get("phase") == "Running" and all(s.get("ready") for s in pod["status"].get("containerStatuses", []))


def until(what: str, check: Any, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not so after {timeout_s:.0f}s")
        time.sleep(0.25)


def gpu_pod(name: str, image: str, gpu_memory_mib: int, command: list[str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A GPU-sharing pod as KAI users write it (KAI's scheduler, simulated through the API, binds it)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": {"gpu-memory": str(gpu_memory_mib), **(annotations or {})}},
            "spec": {"schedulerName": "kai-scheduler", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "cuda", "image": image, "imagePullPolicy": "Never", "command": command}]}}


def workloads(node: Node, namespace: str) -> list[str]:
    """`kind/name` of every Deployment, DaemonSet and StatefulSet in `namespace`."""
    return node.kubectl("get", "deployments,daemonsets,statefulsets", "-n", namespace, "-o", "name").split()


def pod_logs(node: Node, namespace: str) -> str:
    """Every pod's log tail in `namespace`, for a failure message."""
    names = node.kubectl("get", "pods", "-n", namespace, "-o", "name", check=False).split()
    return "\n".join(node.kubectl("logs", "-n", namespace, name, "--all-containers", "--prefix", "--tail=30", check=False, timeout_s=30)
                     for name in names)
