"""The Helm chart installed on the real node as users install it (`helm install kai-resource-isolator
oci://docker.io/projecthami/kai-resource-isolator --version <version>-chart --create-namespace`, with only NATS values),
from the node's registry with its images pinned by digest: every component comes up in runc containers, `helm test`
passes, upstream's kind smoke checks pass on it, a library upgrade leaves running pods alone, and `helm uninstall` leaves
what deploy/README.md says it leaves. Each test runs alone as well as after any other: the two that change the release
have one of their own (`own_release`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kai_isolator.services.devcluster.images import docker_env
from kai_isolator.shared.contract import (
    CONTAINER_NAME_ENV, CONTAINER_VGPU_MOUNT_ENV, DEFAULT_VGPU_MOUNT, GRANT_MOUNT_PATH, INJECT_ANNOTATION, POD_UID_ENV, PRELOAD_PATH,
    SHARED_CACHE_ENV, STATE_MOUNT_PATH, VGPU_VOLUME,
)
from support.pods import cuda_pod
from support.real_node import (
    CHART_IMAGES, NAMESPACE, RELEASE, ChartOnNode, Node, helm, node_helm, published, push_docker_images, workloads,
)
from support.waiting import until

pytestmark = pytest.mark.timeout(600)
INSTALL_TIMEOUT = "300s"
NEXT_NODEAGENT = "kai-isolator-nodeagent:next"
NEXT_TAG = "next-nodeagent"  # beside the release's tags in its repository
CARRIED_LIBRARY = "/opt/kai-isolator/lib/libvgpu.so"  # values.yaml nodeAgent.libraryPath


def active_library(node: Node) -> str | None:
    """The active build's path on the node (and in containers): ld.so.preload names the `libvgpu.so` link, which
    points at `libvgpu.so.<version>`; None before the agent installed one."""
    link = node.node.host_path(DEFAULT_VGPU_MOUNT) / "libvgpu.so"
    preload = node.node.host_path(DEFAULT_VGPU_MOUNT) / "ld.so.preload"
    if not preload.is_file() or not link.is_symlink():
        return None
    assert preload.read_text().split() == [f"{DEFAULT_VGPU_MOUNT}/libvgpu.so"]
    return f"{DEFAULT_VGPU_MOUNT}/{os.path.basename(os.readlink(link))}"


@pytest.fixture(autouse=True)
def _pods_of_each_test_go(real_node: Node) -> None:
    """Through `real_node`: the pods each test applied are deleted after it."""


@pytest.fixture(scope="module")
def chart(real_node_session: Node, chart_images: None, cuda_image: str) -> Iterator[ChartOnNode]:
    """The chart on the node for this module, installed when a test first asks; uninstalled after the module."""
    chart = ChartOnNode(real_node_session, "kai-isolator-helm-nats", INSTALL_TIMEOUT)
    try:
        yield chart
    finally:
        chart.remove()


@pytest.fixture
def release(chart: ChartOnNode) -> Node:
    """The chart installed as published (`helm install --wait`), shared with this module's other tests that leave it
    as they found it."""
    return chart.installed()


@pytest.fixture
def own_release(chart: ChartOnNode) -> Iterator[Node]:
    """The chart installed as published, for a test that changes it (upgrades, uninstalls): removed after the test,
    with the library it left on the node, so the next test that asks installs it afresh on a clean node."""
    try:
        yield chart.installed()
    finally:
        chart.remove(library=True)


def test_every_component_comes_up_on_the_real_node(release: Node) -> None:
    node = release
    status = json.loads(helm(node, "status", RELEASE, "-n", NAMESPACE, "-o", "json"))
    assert status["info"]["status"] == "deployed", status["info"]
    names = workloads(node, NAMESPACE)
    expected = {f"deployment.apps/{RELEASE}-{c}" for c in ("webhook", "watcher", "verifier")}
    expected |= {f"daemonset.apps/{RELEASE}-nodeagent", "statefulset.apps/nats"}
    assert expected <= set(names), names
    for name in names:
        node.kubectl("rollout", "status", name, "-n", NAMESPACE, "--timeout=30s")
    pods = json.loads(node.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json"))["items"]
    for pod in pods:
        assert pod["spec"]["nodeName"] == "gpu-node-1" and pod["status"]["phase"] == "Running", pod["status"]
        assert all(s["ready"] and s["restartCount"] == 0 for s in pod["status"]["containerStatuses"]), pod["status"]["containerStatuses"]
    # The certs hook Jobs ran (and were removed on success): the serving Secret exists, caBundle is set.
    assert node.kubectl("get", "secret", f"{RELEASE}-webhook-tls", "-n", NAMESPACE, "-o", "name").strip()
    webhook = json.loads(node.kubectl("get", "mutatingwebhookconfiguration", f"{RELEASE}-mutating", "-o", "json"))
    assert webhook["webhooks"][0]["clientConfig"].get("caBundle"), webhook["webhooks"][0]["clientConfig"]
    assert not node.kubectl("get", "jobs", "-n", NAMESPACE, "-o", "name").strip()


def test_the_release_is_pulled_by_digest_through_the_mirror(release: Node) -> None:
    """Every image of ours the cluster runs is the published one, by digest, as the chart names it; the node's containerd
    holds it under that name, pulled from the registry (nothing was imported)."""
    node = release
    pinned = {image.pinned for image in published(node).images.values()}
    pods = json.loads(node.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json"))["items"]
    ours = {c["image"] for p in pods for c in p["spec"]["containers"] if "projecthami" in c["image"]}
    assert ours == pinned, (ours, pinned)
    held = node.node.ctr("images", "list", "-q").stdout.split()
    for image in published(node).images.values():
        assert image.by_digest in held, held


def test_helm_test_proves_a_gpu_sharing_pod_gets_the_library(release: Node) -> None:
    """`helm test` passes; and its pod's check tells an injected pod from one that is not: the same pod opted out of
    injection fails, saying why."""
    node = release
    until("the node agent installed the library", lambda: active_library(node), 60)
    out = helm(node, "test", RELEASE, "-n", NAMESPACE, "--timeout", "180s", timeout_s=240)
    assert "TEST SUITE:     kai-resource-isolator-test-library" in out and "Phase:          Succeeded" in out, out

    published_release = published(node)
    rendered = helm(node, "template", RELEASE, published_release.chart, "--version", published_release.chart_version,
                    *node_helm(node).registry_flags, "-n", NAMESPACE, "--show-only", "templates/tests/library.yaml")
    pod = yaml.safe_load(rendered)
    pod["metadata"]["name"] = "library-check-opted-out"
    pod["metadata"]["annotations"] = {"gpu-memory": pod["metadata"]["annotations"]["gpu-memory"], INJECT_ANNOTATION: "false"}
    node.apply_pod(pod)

    def finished() -> str | None:
        phase = node.pod(pod["metadata"]["name"])["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = until("the opted-out check pod finished", finished, 120)
    logs = node.kubectl("logs", pod["metadata"]["name"])
    assert phase == "Failed" and "not injected: no /etc/ld.so.preload" in logs, (phase, logs)


def test_upstreams_kind_smoke_checks_on_the_chart(release: Node, cuda_image: str) -> None:
    """Upstream's kind smoke test, on our chart: the agent Ready, the library and ld.so.preload on the node, the
    injected pod Ready as uid 1000 with the library mapped, a plain and an opted-out pod untouched; and where we
    differ on purpose, ours: the library directory is read-only in the pod."""
    node = release
    agents = json.loads(node.kubectl("get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=nodeagent", "-o", "json"))["items"]
    assert len(agents) == 1 and {"type": "Ready", "status": "True"}.items() <= next(
        c for c in agents[0]["status"]["conditions"] if c["type"] == "Ready").items(), agents[0]["status"]
    library = until("the node agent installed the library", lambda: active_library(node), 60)
    assert node.node.host_path(library).is_file()

    injected = cuda_pod("as-user", cuda_image, 2048, ["sleep", "infinity"])
    injected["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True}
    plain = cuda_pod("plain", cuda_image, 0, ["sleep", "infinity"])
    plain["metadata"].pop("annotations")
    plain["spec"].pop("schedulerName")
    opted_out = cuda_pod("opted-out", cuda_image, 2048, ["sleep", "infinity"], {INJECT_ANNOTATION: "false"})
    for pod in (injected, plain, opted_out):
        node.apply_pod(pod)
    for name in ("as-user", "plain", "opted-out"):
        node.wait_running(name, timeout_s=120)

    pod = node.pod("as-user")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[VGPU_VOLUME]["hostPath"] == {"path": DEFAULT_VGPU_MOUNT, "type": "Directory"}, volumes
    container = pod["spec"]["containers"][0]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[PRELOAD_PATH]["readOnly"] and mounts[PRELOAD_PATH]["subPath"] == "ld.so.preload"
    assert mounts[DEFAULT_VGPU_MOUNT]["readOnly"] and mounts[GRANT_MOUNT_PATH]["readOnly"]
    assert mounts[STATE_MOUNT_PATH].get("subPathExpr", "").startswith(f"$({POD_UID_ENV})_")
    env = {e["name"]: e for e in container["env"]}
    assert env[POD_UID_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env[CONTAINER_NAME_ENV]["value"] == "cuda" and env[CONTAINER_VGPU_MOUNT_ENV]["value"] == DEFAULT_VGPU_MOUNT
    assert SHARED_CACHE_ENV in env
    assert node.kubectl("exec", "as-user", "--", "id", "-u").strip() == "1000"
    assert library in node.kubectl("exec", "as-user", "--", "cat", "/proc/1/maps")
    # Ours, not upstream's: the library directory is read-only in the container (upstream mounts it writable).
    denied = node.plane.kubectl("exec", "as-user", "--", "sh", "-c", f"echo x > {DEFAULT_VGPU_MOUNT}/planted", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied
    for name in ("plain", "opted-out"):
        spec = node.pod(name)["spec"]
        assert not any(v["name"] == VGPU_VOLUME for v in spec.get("volumes", [])), spec
        assert "libvgpu.so" not in node.kubectl("exec", name, "--", "cat", "/proc/1/maps")


def test_the_webhook_fails_closed(release: Node, cuda_image: str) -> None:
    """Ours, not upstream's (Ignore): with no webhook pod to answer, a GPU-sharing pod is refused, any other admitted."""
    node = release
    deployment = f"deployment/{RELEASE}-webhook"
    node.kubectl("scale", deployment, "-n", NAMESPACE, "--replicas=0")
    try:
        node.kubectl("wait", "--for=delete", "pod", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=webhook", "--timeout=60s", timeout_s=90)
        refused = node.plane.kubectl("apply", "-f", "-", input_text=json.dumps(cuda_pod("unserved", cuda_image, 1024, ["sleep", "infinity"])), check=False)
        assert refused.returncode != 0 and "vgpu.lib.kai-resource-isolator.io" in refused.stderr, refused
        plain = cuda_pod("plain-while-down", cuda_image, 0, ["sleep", "infinity"])
        plain["metadata"].pop("annotations")
        plain["spec"].pop("schedulerName")
        node.apply_pod(plain)
    finally:
        node.kubectl("scale", deployment, "-n", NAMESPACE, "--replicas=2")
        node.kubectl("rollout", "status", deployment, "-n", NAMESPACE, "--timeout=120s", timeout_s=150)


def next_library_image(tmp_path: Path) -> str:
    """A node agent image carrying another build of the library: the same code with a note appended (a new sha256,
    so a new version to the agents; the loader ignores bytes past the ELF's segments). Returns the library's version."""
    env = docker_env()

    def docker(*args: str) -> str:
        done = subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done
        return done.stdout.strip()

    container = docker("create", CHART_IMAGES[1])
    try:
        docker("cp", f"{container}:{CARRIED_LIBRARY}", str(tmp_path / "libvgpu.so"))
        with open(tmp_path / "libvgpu.so", "ab") as library:
            library.write(b"\0kai-isolator test build: next\0")
        docker("cp", str(tmp_path / "libvgpu.so"), f"{container}:{CARRIED_LIBRARY}")
        docker("commit", container, NEXT_NODEAGENT)
    finally:
        docker("rm", container)
    return hashlib.sha256((tmp_path / "libvgpu.so").read_bytes()).hexdigest()[:16]


def test_helm_upgrade_to_a_new_library_leaves_running_pods_alone(own_release: Node, cuda_image: str, tmp_path: Path) -> None:
    node = own_release
    old = until("the node agent installed the library", lambda: active_library(node), 60)
    node.apply_pod(cuda_pod("before-upgrade", cuda_image, 1024, ["sleep", "infinity"]))
    node.wait_running("before-upgrade", timeout_s=120)
    assert old in node.kubectl("exec", "before-upgrade", "--", "cat", "/proc/1/maps")

    version = next_library_image(tmp_path)
    published_release = published(node)
    [pushed] = push_docker_images(node, {NEXT_NODEAGENT: f"{published_release.chart.removeprefix('oci://')}:{NEXT_TAG}"}).values()
    started = time.monotonic()
    helm(node, "upgrade", RELEASE, published_release.chart, "--version", published_release.chart_version, *node_helm(node).registry_flags,
         "-n", NAMESPACE,
         "--reuse-values", "--set", f"nodeAgent.image.tag={NEXT_TAG}", "--set", f"nodeAgent.image.digest={pushed.digest}",
         "--set", f"installer.rollout.version={version}", "--wait", "--timeout", INSTALL_TIMEOUT, timeout_s=360)
    new = until("the rollout made the new version active", lambda: (active := active_library(node)) != old and active, 180)
    assert new.endswith(f".{version}"), (new, version)
    print(f"\nhelm upgrade to the new library active on the node: {time.monotonic() - started:.1f}s ({old} -> {new})", file=sys.stderr)

    # The running pod keeps the library it mapped, and still runs; a new pod gets the new one.
    before = node.pod("before-upgrade")["status"]["containerStatuses"][0]
    assert before["restartCount"] == 0 and "running" in before["state"], before
    assert old in node.kubectl("exec", "before-upgrade", "--", "cat", "/proc/1/maps")
    assert node.node.host_path(old).is_file()  # kept while a process maps it
    node.apply_pod(cuda_pod("after-upgrade", cuda_image, 1024, ["sleep", "infinity"]))
    node.wait_running("after-upgrade", timeout_s=120)
    maps = node.kubectl("exec", "after-upgrade", "--", "cat", "/proc/1/maps")
    assert new in maps and old not in maps, maps


def test_helm_uninstall_leaves_what_the_readme_says(own_release: Node, cuda_image: str) -> None:
    """deploy/README.md: `helm uninstall`, then `kai-isolator nodeagent uninstall --host-root /` on each GPU node, which
    stops preloading first and keeps any version a process still maps."""
    node = own_release
    node.apply_pod(cuda_pod("outlives-the-release", cuda_image, 1024, ["sleep", "infinity"]))
    node.wait_running("outlives-the-release", timeout_s=120)
    preload = node.node.host_path(DEFAULT_VGPU_MOUNT) / "ld.so.preload"
    mapped = active_library(node)
    assert mapped is not None

    helm(node, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s", timeout_s=180)
    until("the release's pods are gone", lambda: not node.kubectl("get", "pods", "-n", NAMESPACE, "-o", "name").strip(), 120)
    assert not workloads(node, NAMESPACE)
    for kind in ("mutatingwebhookconfigurations", "clusterroles", "clusterrolebindings"):
        left = node.kubectl("get", kind, "-o", "name", "-l", "app.kubernetes.io/part-of=kai-resource-isolator")
        assert not left.strip(), left
    # What Kubernetes keeps: the namespace helm created and the StatefulSet's volume claim; on the node, the library.
    assert node.kubectl("get", "namespace", NAMESPACE, "-o", "name").strip()
    assert node.kubectl("get", "pvc", "data-nats-0", "-n", NAMESPACE, "-o", "name").strip()
    assert preload.is_file() and node.node.host_path(mapped).is_file()
    survivor = node.pod("outlives-the-release")["status"]["containerStatuses"][0]
    assert survivor["restartCount"] == 0 and "running" in survivor["state"], survivor

    # The node's own uninstall, run as the README says but against the node's root from this machine.
    root = node.node.root
    done = subprocess.run([str(Path(sys.executable).parent / "kai-isolator"), "nodeagent", "uninstall", "--host-root", str(root)],
                          capture_output=True, text=True, timeout=120)
    # 3: done, but a version is kept for the processes that map it (run again once they exit).
    assert done.returncode == 3 and mapped.rsplit(".", 1)[1] in done.stderr and "still in use" in done.stderr, done
    assert not preload.exists()
    assert node.node.host_path(mapped).is_file(), "a version a running process maps is kept"
    assert mapped in node.kubectl("exec", "outlives-the-release", "--", "cat", "/proc/1/maps")
