"""The real node as the tests drive it: the node and its cluster (kubectl), the loop they run on, the one node of a test
process and its fixtures (tests/realnode and tests/security/real_node both run on it: their conftests import
`build_node`, `real_node_session`, `real_node`, `cuda_image`), our services beside it, our chart and manifests installed
on it as users install them, and the node's fake driver's ledger, the judge."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import pytest

from kai_isolator.services.devcluster import build, images
from kai_isolator.services.devcluster.build import BuildError, ensure_node
from kai_isolator.services.devcluster.fake_gpu_ledger import MIB, FakeGpu
from kai_isolator.services.devcluster.oci import image_archive, with_libraries
from kai_isolator.services.devcluster.oci_push import PushedImage, push_archive
from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.services.devcluster.realcluster import RealNodeCluster
from kai_isolator.services.devcluster.realnode import RealNode
from kai_isolator.services.devcluster.release import Helm, Release, layer_cache, publish, push_docker_image, registry_client, report
from kai_isolator.services.admission import dev as admission_dev
from kai_isolator.services.dev import DevContext
from kai_isolator.services.nodeagent.agent import NodeAgent
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.services.verifier import dev as verifier_dev
from kai_isolator.services.watcher import dev as watcher_dev
from kai_isolator.shared.bus import connect, provision_stream
from kai_isolator.shared.contract import DEFAULT_VGPU_MOUNT
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.settings import BusSettings
from support import REPO
from support.building import build_before_tests

HAMI_BUILD = REPO / "hami-core" / "build"
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
    images: set[str] = field(default_factory=set)  # pulled into the node's containerd
    release: Release | None = None  # ours, published into the node's registry (`published`)

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


# --- the one real node of a test process ---------------------------------------------------------------------------

START_TIMEOUT_S = 300.0


@dataclass
class _Session:
    node: Node
    users: int = 0


_SESSION: list[_Session] = []
"""The process's real node, if started, and how many session fixtures hold it (tests/realnode's and
tests/security/real_node's: conftest.SHARED_ONCE keeps both in one xdist worker, so one node serves both)."""


@contextlib.contextmanager
def one_real_node(workdir: Path) -> Iterator[Node]:
    """The real node of this test process: started by the first session fixture that asks, stopped when the last ends."""
    if not _SESSION:
        loop = LoopThread()
        real = RealNodeCluster(workdir=workdir)
        try:
            loop.run(real.start(), START_TIMEOUT_S)
        except BaseException:
            with contextlib.suppress(Exception):
                loop.run(real.stop(), 120)
            loop.close()
            raise
        phases = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in real.startup_s.items())
        print(f"\nreal node ready: {phases}", file=sys.stderr, flush=True)
        _SESSION.append(_Session(Node(real, loop)))
    session = _SESSION[0]
    session.users += 1
    try:
        yield session.node
    finally:
        session.users -= 1
        if not session.users:
            _SESSION.clear()
            with contextlib.suppress(Exception):
                session.node.loop.run(session.node.real.stop(), 120)
            session.node.loop.close()


_built: list[object] = []


def build_node(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the node's programs before any test runs, as the control plane's are; once a process, whichever conftest asks."""
    if _built:
        return
    built = build_before_tests(config, items, {"real_node_session"}, lambda: ensure_node(sys.stderr), BuildError)
    if built is not None:
        _built.append(built)


@pytest.fixture(scope="session")
def real_node_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    if _built and isinstance(_built[0], BuildError):
        raise _built[0]
    with one_real_node(tmp_path_factory.mktemp("real-node")) as node:
        yield node


@pytest.fixture
def real_node(real_node_session: Node) -> Iterator[Node]:
    """The session's real node; the pods a test applied through it are gone after the test."""
    try:
        yield real_node_session
    finally:
        real_node_session.clean()


@pytest.fixture(scope="session")
def cuda_image(real_node_session: Node, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The stand-in of the seed's `nvidia/cuda` image in the node's containerd (import_cuda_image)."""
    return import_cuda_image(real_node_session, tmp_path_factory.mktemp("images"))


def import_cuda_image(node: Node, workdir: Path) -> str:
    """A stand-in of `nvidia/cuda:12.9.2-base-ubuntu24.04` (no public registry is reachable) pushed to the node's registry
    under that name and pulled through the node's docker.io mirror, once: this machine's shell and core tools with their
    libraries, CUDA programs (`cuprobe`, `rawelf`), and the CUDA base image's environment (`NVIDIA_VISIBLE_DEVICES=all`
    included); no driver, which the `nvidia` runtime adds, as on a GPU node. Pulled ahead (as `crictl pull` would) for the
    tests' pods that never pull; the seed's pod names it as users do and finds it as any pull would."""
    if CUDA_IMAGE in node.images:
        return CUDA_IMAGE
    tools = {f"/usr/bin/{name}": Path(f"/usr/bin/{name}") for name in ("cat", "sleep", "grep", "id", "env", "ls", "head")}
    files = {"/bin/sh": Path("/bin/dash"), **tools, "/usr/local/bin/cuprobe": HAMI_BUILD / "tests" / "cuprobe",
             "/usr/local/bin/rawelf": HAMI_BUILD / "tests" / "rawelf",
             # glibc's compatibility stubs, which Ubuntu 24.04 (the real image) has: a libvgpu.so built on an older glibc,
             # as the node agent's image builds it, names them.
             **{f"/lib/x86_64-linux-gnu/{stub}": Path(f"/lib/x86_64-linux-gnu/{stub}") for stub in ("libdl.so.2", "libpthread.so.0")}}
    archive = image_archive(CUDA_IMAGE, with_libraries(files, provided=("libcuda.so.1", "libnvidia-ml.so.1")), workdir / "cuda.tar",
                            command=["/bin/sh"], env={"PATH": "/usr/local/bin:/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES": "all",
                                                      "NVIDIA_DRIVER_CAPABILITIES": "compute,utility", "CUDA_VERSION": "12.9.2"})
    assert node.real.registry is not None
    push_archive(registry_client(node.real.registry), archive, CUDA_IMAGE, layer_cache())
    node.node.pull_image(CUDA_IMAGE)
    node.images.add(CUDA_IMAGE)
    return CUDA_IMAGE


# --- our services beside the node, as local processes at their shipped defaults ---------------------------------------


@contextlib.asynccontextmanager
async def isolation_services(node: Node, workdir: Path, nats_url: str, nri: bool = False) -> AsyncIterator[DevContext]:
    """The webhook (registered, failurePolicy Fail), watcher, verifier and node agent at their shipped defaults; the
    agent is `ctx.values["agent"]`. With `nri`, the agent takes part in container creation: its decision socket is on,
    and its NRI plugin (built from services/nodeagent/nri) runs on the node, registered with the node's containerd."""
    bus = BusSettings(nats_url=nats_url)
    nc = await connect(bus, nats_url, "real-node-tests")
    try:
        await provision_stream(nc.jetstream(timeout=bus.jetstream_timeout_s), bus)
    finally:
        await nc.drain()
    ctx = DevContext(nats_url=nats_url, bus=bus, workdir=workdir)
    cluster = node.real.cluster
    gpu = node.real.gpu
    assert cluster is not None and gpu is not None
    ctx.values["kubeconfig"] = cluster.kubeconfig
    if nri:  # as the chart sets it with nodeAgent.nri.enabled: GPU-sharing containers need the agent's plugin
        ctx.values["require_nri_plugin"] = "kai-isolator"
    async with contextlib.AsyncExitStack() as stack:
        # The enforcer's NVML is the node's (fake) driver, answering from the node's ledger process beside it, the one
        # every container's libraries reach through the socket the nvidia runtime binds in.
        await stack.enter_async_context(admission_dev.component(ctx))
        registered = await cluster.register_webhook(ctx.values["admission_url"], ctx.values["admission_ca_bundle"], failure_policy="Fail")
        stack.push_async_callback(cluster.unregister_webhook, registered["metadata"]["name"])  # the tests after this module's
        await stack.enter_async_context(watcher_dev.component(ctx))
        await stack.enter_async_context(verifier_dev.component(ctx))
        settings = NodeAgentSettings(node_name="gpu-node-1", host_root=node.node.root, library=[HAMI_BUILD / "libvgpu.so"],
                                     kubeconfig=cluster.kubeconfig, nvml_library=str(gpu.driver / "libnvidia-ml.so.1"),
                                     status_interval_s=5, usage_interval_s=5, nri_socket=workdir / "agent-nri.sock" if nri else None)
        agent = NodeAgent(settings, bus)
        await agent.start(nats_url)
        stack.push_async_callback(agent.stop)
        ctx.values["agent"] = agent
        if nri:
            plugin = await asyncio.to_thread(build.nri_plugin)
            await asyncio.to_thread(node.node.start_nri_plugin, plugin, workdir / "agent-nri.sock")
            stack.callback(node.node.stop_nri_plugin)
        yield ctx


@contextlib.contextmanager
def isolated(node: Node, workdir: Path, nri: bool = False) -> Iterator[DevContext]:
    """NATS and `isolation_services`, for the length of a module."""
    nats = EmbeddedNats(workdir / "jetstream")
    nats.start()
    running = isolation_services(node, workdir, nats.url, nri=nri)
    try:
        yield node.loop.run(running.__aenter__(), 120)
    finally:
        with contextlib.suppress(Exception):
            node.loop.run(running.__aexit__(None, None, None), 60)
        nats.kill()


# --- the chart and the manifests on the real node, installed as users install them ------------------------------

# The seed's example, verbatim; its image is a local stand-in of that name, in the node's registry (import_cuda_image).
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

CHART = REPO / "deploy" / "helm" / "kai-resource-isolator"
DEV_OVERLAY = REPO / "deploy" / "kustomize" / "overlays" / "dev"
RELEASE = NAMESPACE = "kai-resource-isolator"
# What `make images` leaves in the Docker engine that the chart and the overlay name: the release's two images and the
# NATS stand-in, which the node's registry serves under its public name.
NATS_IMAGE = "nats:2.10.22-alpine"
CHART_IMAGES = (images.SERVICES_IMAGE.tag, images.NODEAGENT_IMAGE.tag, NATS_IMAGE)
THIRD_PARTY_IMAGES = {NATS_IMAGE: "docker.io/library/nats:2.10.22-alpine"}
# Only NATS values: the chart comes from the registry naming its images by digest, and the node's /usr/local and
# /var/lib are its own (the work dir's), so the chart's host paths stay at their defaults.
CHART_VALUES = {"nats.enabled": "true"}
NATS_UID = 1000  # the chart's NATS runs as 1000 with fsGroup 1000, which a hostPath volume does not apply


def build_chart_images(log: TextIO) -> None:
    """The chart's images built from this tree, so no test installs an image of older code; Docker's layer cache makes
    an unchanged tree cost seconds (the compose suite has built the same images already in a full run). And helm, which
    publishes and installs the chart."""
    build.helm(log)
    kube_builder = images.ensure_prerequisites(log)
    for image in images.PROJECT_IMAGES:
        if image.tag in CHART_IMAGES:
            images.build_image(image, kube_builder, log)


def push_docker_images(node: Node, references: dict[str, str]) -> dict[str, PushedImage]:
    """Images of the engine pushed to the node's registry under the names the cluster pulls them by."""
    assert node.real.registry is not None
    return {tag: push_docker_image(node.real.registry, tag, reference) for tag, reference in references.items()}


def published(node: Node) -> Release:
    """Our release in the node's registry, once per node, as `make release` publishes it (images, then the chart pinning
    them), with the third-party images it names beside it."""
    if node.release is None:
        started = time.monotonic()
        push_docker_images(node, THIRD_PARTY_IMAGES)
        workdir = node.real.workdir / "release"
        workdir.mkdir(exist_ok=True)
        assert node.real.registry is not None
        node.release = publish(node.real.registry, node_helm(node), workdir)
        print(f"\nreleased into the node's registry in {time.monotonic() - started:.1f}s:\n{report(node.release)}", file=sys.stderr)
    return node.release


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


def node_helm(node: Node) -> Helm:
    """helm as a user on this machine runs it against the node's cluster, docker.io resolving to the node's registry."""
    assert node.real.registry is not None
    return Helm(build.helm(), node.real.workdir / "helm", node.real.registry, kubeconfig=node.plane.admin_kubeconfig)


def helm(node: Node, *args: str, timeout_s: float = 300) -> str:
    done = node_helm(node).run(*args, timeout_s=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@contextlib.contextmanager
def chart_release(node: Node, volume: str, install_timeout: str = "300s") -> Iterator[float]:
    """Our chart installed as users install it, `helm install kai-resource-isolator oci://docker.io/projecthami/
    kai-resource-isolator --version <version>-chart --create-namespace --wait` (only NATS values), from the node's registry
    (`published`); the node pulls its images by digest through its docker.io mirror. Uninstalled afterwards unless a test
    did. Yields the seconds install took to all Ready."""
    release = published(node)
    nats_volume(node, volume)
    started = time.monotonic()
    try:
        helm(node, "install", RELEASE, release.chart, "--version", release.chart_version, *node_helm(node).registry_flags,
             "-n", NAMESPACE, "--create-namespace", *[flag for key, value in CHART_VALUES.items() for flag in ("--set", f"{key}={value}")],
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


class ChartOnNode:
    """Our chart on the node for one module's tests (`chart_release`), installed when a test first asks for it and kept
    for the next, unless a test changed it (an upgrade, an uninstall): then it is removed after that test and the next
    test that asks installs it afresh. So each test finds the release as published, alone or after any other."""

    def __init__(self, node: Node, volume: str, install_timeout: str = "300s") -> None:
        self.node, self.volume, self.install_timeout = node, volume, install_timeout
        self._installed: contextlib.ExitStack | None = None

    def installed(self) -> Node:
        """The node with the chart installed as published (`helm install --wait`, unless it still is)."""
        if self._installed is None:
            stack = contextlib.ExitStack()
            stack.enter_context(chart_release(self.node, self.volume, self.install_timeout))
            self._installed = stack
        return self.node

    def remove(self, library: bool = False) -> None:
        """Uninstall the chart (if a test has not) and what it left in the cluster; with `library`, also the node's
        library directory, which `helm uninstall` leaves (deploy/README.md), so the next install starts clean."""
        stack, self._installed = self._installed, None
        if stack is not None:
            stack.close()
        if library:
            shutil.rmtree(self.node.node.host_path(DEFAULT_VGPU_MOUNT), ignore_errors=True)


def is_running(pod: dict[str, Any]) -> bool:
    """Running with every container ready, as `kubectl wait --for=condition=Ready` would have it."""
    return pod["status"].get("phase") == "Running" and all(s.get("ready") for s in pod["status"].get("containerStatuses", []))


def workloads(node: Node, namespace: str) -> list[str]:
    """`kind/name` of every Deployment, DaemonSet and StatefulSet in `namespace`."""
    return node.kubectl("get", "deployments,daemonsets,statefulsets", "-n", namespace, "-o", "name").split()


def pod_logs(node: Node, namespace: str) -> str:
    """Every pod's log tail in `namespace`, for a failure message."""
    names = node.kubectl("get", "pods", "-n", namespace, "-o", "name", check=False).split()
    return "\n".join(node.kubectl("logs", "-n", namespace, name, "--all-containers", "--prefix", "--tail=30", check=False, timeout_s=30)
                     for name in names)


# --- the judge: the node's fake driver's ledger ---------------------------------------------------------------------

def ledger(node: Node) -> FakeGpu:
    """The node's ledger, queried from the host through the socket beside the node's driver (never started here)."""
    assert node.real.gpu is not None
    return FakeGpu(node.real.gpu.driver)


class LedgerWatch:
    """The ledger sampled every 20 ms from another thread while an attack runs: the peak of `measure` (by default the
    node-wide memory every process holds, contexts included), how long it was over `over` bytes, and the MiB·s over it
    (the memory a neighbour could not have, times how long)."""

    PERIOD_S = 0.02

    def __init__(self, gpu: FakeGpu, over: int, measure: Callable[[FakeGpu], int] | None = None) -> None:
        self.gpu, self.over = gpu, over
        self.measure = measure or (lambda ledger: sum(ledger.processes(0).values()))
        self.peak = 0
        self.over_mib_s = 0.0
        self.first_over: float | None = None
        self.last_over: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="ledger-watch", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            total = self.measure(self.gpu)
            self.peak = max(self.peak, total)
            if total > self.over:
                now = time.monotonic()
                self.first_over = self.first_over or now
                self.last_over = now
                self.over_mib_s += (total - self.over) / MIB * self.PERIOD_S

    @property
    def over_s(self) -> float | None:
        return None if self.first_over is None or self.last_over is None else self.last_over - self.first_over + self.PERIOD_S

    @property
    def peak_over_mib(self) -> int:
        return max(0, self.peak - self.over) >> 20

    def __enter__(self) -> LedgerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
