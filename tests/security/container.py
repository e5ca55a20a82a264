"""Simulated GPU-sharing containers built exactly as our webhook injects them, for attack tests.

A pod goes through the real admission mutation (services/admission), gets KAI's limit
ConfigMap, and is started by the demo kubelet: private mount namespace, read-only library
dir and preload (and grant dir when the webhook mounts one), writable state dir, in a cgroup
named as the kubelet names it. Every process talks to the fake driver, whose books one private
node-side ledger process keeps (services/devcluster/fake_gpu_ledger.py, reached through the socket beside the driver's
libraries, never through anything the tenant sets), so a test asserts on what really reached the
"driver", then runs the node agent's inspection and the verifier's judgement on the container.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch

from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.webhook import Webhook
from kai_isolator.services.demo.kubelet import CgroupPlacement, ContainerProcess, start_container
from kai_isolator.services.devcluster.fake_gpu_ledger import FAKE_CONTEXT_OVERHEAD_BYTES, FakeGpu
from kai_isolator.services.nodeagent import creation, install, observe
from kai_isolator.services.nodeagent.layout import HostLayout
from kai_isolator.services.nodeagent.nvml import Nvml
from kai_isolator.services.verifier.judge import Judgement, judge
from kai_isolator.shared.cgroups import CgroupDriver
from kai_isolator.shared.contract import (
    DEFAULT_GRANT_DIR, DEFAULT_VGPU_MOUNT, GPU_MEMORY_ANNOTATION, GRANT_FILE, GRANT_VOLUME, LIMIT_ENV,
)
from kai_isolator.shared.events import InspectReply, InspectRequest, PodIsolation, PodRef
from kai_isolator.shared.grant import DeviceGrant, Grant, GrantSource
from kai_isolator.shared.limits import parse_limit
from support import REPO, pods, run_summary

BUILD = REPO / "hami-core" / "build"
LIBVGPU = BUILD / "libvgpu.so"
FAKE_DIR = BUILD / "fake"
CUPROBE = BUILD / "tests" / "cuprobe"
NAMESPACE = "tenant"
NODE = "gpu-node-sec"
GIB = 1 << 30
MIB = 1 << 20
CONTEXT = FAKE_CONTEXT_OVERHEAD_BYTES  # what the fake driver charges each context, in NVML's figure for its process
FAKE_GPU_UUID = "GPU-0000fa4e-1111-2222-3333-000000000000"  # the fake NVML's device 0
DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
LIBRARY_PATH = f"{DEFAULT_VGPU_MOUNT}/libvgpu.so"  # what the verifier expects in /etc/ld.so.preload

Obj = dict[str, Any]


# A pod as a tenant submits it (support.pods.gpu_pod: `gpu_memory`, `containers`, `annotations`, ...): KAI's gpu-memory
# annotation, 1024 MiB unless the test says, a uid of its own, nothing of ours yet.
gpu_pod = functools.partial(pods.gpu_pod, namespace=NAMESPACE, uid=lambda: str(uuid.uuid4()), gpu_memory="1024",
                            image="tenant/cuda:latest", command=["train"])


def admit(pod: Obj, config: InjectionConfig | None = None) -> Obj:
    """The pod after our webhook: the real decision logic on a real AdmissionReview, its patch applied."""
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "operation": "CREATE",
        "namespace": pod["metadata"]["namespace"], "object": pod}}
    answer = Webhook(config or InjectionConfig(), "warn").handle(json.dumps(review).encode())
    response = json.loads(answer.body)["response"]
    assert response["allowed"], response
    patch = json.loads(base64.b64decode(response["patch"])) if response.get("patch") else []
    return jsonpatch.apply_patch(pod, patch)


def without_grant(pod: Obj) -> Obj:
    """The pod without our grant volume and mounts: what the environment contract alone gives."""
    stripped = json.loads(json.dumps(pod))
    stripped["spec"]["volumes"] = [v for v in stripped["spec"].get("volumes") or [] if v.get("name") != GRANT_VOLUME]
    for spec in stripped["spec"].get("containers") or []:
        spec["volumeMounts"] = [m for m in spec.get("volumeMounts") or [] if m.get("name") != GRANT_VOLUME]
    return stripped


def kai_bind(pod: Obj, limit: str, container: str = "main") -> tuple[Obj, dict[str, dict[str, str]]]:
    """What KAI adds at binding: the limit and the reserved GPU (NVIDIA_VISIBLE_DEVICES) from a ConfigMap its
    binder writes, and the node."""
    bound = json.loads(json.dumps(pod))
    configmap = f"{pod['metadata']['name']}-shared-gpu-0"
    for spec in [*bound["spec"].get("initContainers", []), *bound["spec"]["containers"]]:
        if spec["name"] == container:
            spec.setdefault("env", []).extend({"name": name, "valueFrom": {"configMapKeyRef": {
                "name": configmap, "key": name, "optional": True}}} for name in (LIMIT_ENV, DEVICES_ENV))
    bound["spec"]["nodeName"] = NODE
    return bound, {configmap: {LIMIT_ENV: limit, DEVICES_ENV: FAKE_GPU_UUID}}


class Background:
    """A program running inside a container; its merged output is read line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []

    async def wait_for(self, text: str | tuple[str, ...], timeout_s: float = 30) -> str:
        """The first line (from now) containing `text` (one of them); fails with everything read if the program exits
        first."""
        texts = (text,) if isinstance(text, str) else text
        assert self.process.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
            if not raw:
                raise AssertionError(f"exited ({await self.process.wait()}) before printing {text!r}: {self.lines}")
            line = raw.decode().rstrip("\n")
            self.lines.append(line)
            if any(t in line for t in texts):
                return line

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()


@dataclass
class Container:
    """One running simulated container and what the tests need to attack and judge it."""

    pod: Obj
    name: str
    limit: str
    process: ContainerProcess
    node: SimNode
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def pod_ref(self) -> PodRef:
        meta = self.pod["metadata"]
        return PodRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

    @property
    def container_id(self) -> str:
        return self.process.container_id

    @property
    def env(self) -> dict[str, str]:
        """The environment kubelet gave the container (the tenant can change it in its processes)."""
        return self.process.env

    @property
    def state_dir(self) -> Path:
        """The container's writable state dir, on the host (`/run/kai-isolator` inside)."""
        return self.node.layout.containers_dir / f"{self.pod_ref.uid}_{self.name}"

    async def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside the container (its cgroup and mounts), like `kubectl exec`; `env` replaces the container's."""
        process = await asyncio.create_subprocess_exec(
            *self.process.inside(argv), env=self.env if env is None else env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
        return subprocess.CompletedProcess(argv, process.returncode or 0, out.decode(), err.decode())

    async def background(self, argv: list[str], env: dict[str, str] | None = None) -> Background:
        """Start `argv` inside the container and leave it running (killed when the node stops)."""
        process = await asyncio.create_subprocess_exec(
            *self.process.inside(argv), env=self.env if env is None else env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        started = Background(process)
        self.node.background.append(started)
        return started

    async def hold(self, nbytes: int, env: dict[str, str] | None = None) -> Background:
        """A CUDA process in the container that allocates `nbytes` (CUDA_SUCCESS asserted) and keeps them."""
        holder = await self.background([str(CUPROBE), "init", "ctx", "0", "alloc", str(nbytes), "hold", "600000"], env)
        line = await holder.wait_for("alloc ")
        assert " rc=0" in line, line
        await holder.wait_for("holding")
        return holder

    @property
    def grant_mounted(self) -> bool:
        """The webhook mounted the node-written grant into this container."""
        return any(v.get("name") == GRANT_VOLUME for v in self.pod["spec"].get("volumes") or [])

    @property
    def healthy_codes(self) -> list[str]:
        """The reasons a well-behaved container of this pod is judged with: none with a grant,
        `limit-from-env` without (its limit then comes from an environment the tenant controls)."""
        return [] if self.grant_mounted else ["limit-from-env"]

    def isolation(self) -> PodIsolation:
        """The `running` event the watcher would publish for this pod."""
        return PodIsolation(pod=self.pod_ref, resource_version="1", state="running", phase="Running", node_name=NODE,
                            container=self.name, injected=True, gpu_memory=self.pod["metadata"]["annotations"].get(GPU_MEMORY_ANNOTATION),
                            expected_limit=self.limit)

    def inspect(self, *, with_container_id: bool = True) -> InspectReply:
        """What the node agent answers the verifier about this container, right now."""
        request = InspectRequest(node_name=NODE, pod=self.pod_ref, container=self.name,
                                 **({"container_id": self.container_id} if with_container_id else {}))
        return self.node.inspect(request)

    def judge(self, reply: InspectReply | None = None) -> Judgement:
        """The verifier's verdict on what the node agent sees."""
        return judge(self.isolation(), reply or self.inspect(), LIBRARY_PATH)


def record_outcome(attack: str, outcome: str, verdict: str) -> None:
    """One row of the escape table printed after the tests: the attack, its outcome against the fake driver, the verdict."""
    run_summary.add("attacks as run (tests/security)", f"{attack:<32} {outcome:<42} {verdict}")


def record_shipped(attack: str, peak: str, acted: str, verdict: str) -> None:
    """One row of the table of attacks at the shipped defaults, printed after the tests."""
    run_summary.add("attacks at the shipped defaults (tests/security/test_shipped_defaults.py)",
                f"{attack:<48} {peak:>12} {acted:>12}  {verdict}",
                header=f"{'attack':<48} {'ledger peak':>12} {'time to act':>12}  verdict")


def blocked_or_detected(container: Container, grant_bytes: int, *codes: str) -> str:
    """The outcome of an attack that is over: `blocked` when the fake driver never held more than the
    grant for the whole node, else `detected`, which needs a verdict naming every one of `codes`."""
    peak = container.node.driver_stats()["peak"]
    judgement = container.judge()
    named = [reason.code for reason in judgement.reasons]
    outcome = "blocked" if peak <= grant_bytes else "detected"
    if outcome == "detected":
        assert judgement.verdict != "verified" and set(codes) <= set(named), (
            f"past the grant (driver peak {peak} bytes) and the verdict is {judgement.verdict} {judgement.reasons}")
    record_outcome(f"{container.pod_ref.name} [{container.node.driver.value}]", f"{outcome} (driver peak {peak >> 20} MiB of {grant_bytes >> 20})",
                   f"{judgement.verdict}: {', '.join(named) or '-'}")
    return outcome


def decoy_library(directory: Path) -> Path:
    """What a tenant brings: a shared object named libvgpu.so that intercepts nothing."""
    directory.mkdir(parents=True, exist_ok=True)
    source, decoy = directory / "decoy.c", directory / "libvgpu.so"
    source.write_text("int kai_decoy_marker = 1;\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(decoy), str(source)], check=True, capture_output=True)
    return decoy


def tenant_grant(directory: Path, limit_bytes: int = 15 << 30) -> Path:
    """What a tenant writes where it can write: a grant.json of its own choosing, in the node's format."""
    directory.mkdir(parents=True, exist_ok=True)
    grant = Grant(pod_uid="forged", namespace=NAMESPACE, pod="forged", container="main",
                  devices=(DeviceGrant(uuid=FAKE_GPU_UUID, limit_bytes=limit_bytes),), source=GrantSource.CONFIGMAP)
    (directory / GRANT_FILE).write_text(grant.model_dump_json())
    return directory


@dataclass
class SimNode:
    """One simulated GPU node: a temp host root with our library installed, a fake GPU whose
    node-side ledger process keeps its books, and a kubelet that places containers in kubelet-named cgroups."""

    root: Path
    scratch: Path
    driver: CgroupDriver
    gpu_total_mib: int = 15360
    driver_branch: int = 580  # 615: NVML 13.4's per-cgroup limits, each container's leaf capped as it starts
    layout: HostLayout = field(init=False)
    gpu: FakeGpu = field(init=False)
    placement: CgroupPlacement = field(init=False)
    version: str = field(init=False)
    containers: list[Container] = field(default_factory=list)
    background: list[Background] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.layout = HostLayout(self.root, DEFAULT_VGPU_MOUNT)
        self.placement = CgroupPlacement(prefix=f"kai-sec-{uuid.uuid4().hex[:12]}", driver=self.driver)
        _, self.version = install.read_library(LIBVGPU)
        install.activate(self.layout, self.version, {self.version: LIBVGPU})
        # The node's driver folder: the fake libraries and the ledger's socket beside them (last: stop() ends it).
        self.gpu = FakeGpu(self.scratch / "nvidia-driver", total_mib=self.gpu_total_mib, driver_branch=self.driver_branch).start()

    @property
    def driver_env(self) -> dict[str, str]:
        """What the node gives every container to find the (fake) driver's libraries, as the runtime's
        ld.so.cache does for the real one; the ledger needs nothing more. An attack that clears its
        environment puts this back (a real container finds the driver without it)."""
        return {"LD_LIBRARY_PATH": str(self.gpu.folder)}

    async def start(self, pod: Obj, argv: list[str] | None = None, *, limit: str = "1g", container: str = "main",
                    grant: bool = True, grant_written: bool = True) -> Container:
        """Admit `pod`, bind it with `limit`, write its grant, and start `container` running `argv`
        (by default a process that idles, for attacks run with `exec`). `grant=False` takes the grant
        mount out again (the environment contract alone, as with HAMi-core); `grant_written=False`
        leaves the mounted grant directory empty (the node agent has not written it)."""
        admitted = admit(pod) if grant else without_grant(admit(pod))
        bound, configmaps = kai_bind(admitted, limit, container)
        bound["status"] = {"phase": "Running"}
        if grant and grant_written:
            self.write_grant(bound, container, limit)
        return await self._run(bound, container, limit, argv, configmaps)

    async def start_also(self, first: Container, container: str, argv: list[str] | None = None) -> Container:
        """Start another container of `first`'s pod (a sidecar): the node wrote no grant for it."""
        return await self._run(first.pod, container, first.limit, argv, first.configmaps)

    async def _run(self, bound: Obj, container: str, limit: str, argv: list[str] | None,
                   configmaps: dict[str, dict[str, str]]) -> Container:
        specs = [("initContainerStatuses", c) for c in bound["spec"].get("initContainers", [])]
        specs += [("containerStatuses", c) for c in bound["spec"]["containers"]]
        statuses, spec = next((key, c) for key, c in specs if c["name"] == container)
        process = await start_container(
            bound, spec, argv or ["sleep", "infinity"], configmaps=configmaps, host_root=self.root,
            scratch=self.scratch / f"{bound['metadata']['name']}-{container}", extra_env=self.driver_env, placement=self.placement,
        )
        bound["status"].setdefault(statuses, []).append({"name": container, "containerID": f"containerd://{process.container_id}"})
        started = Container(bound, container, limit, process, self, configmaps)
        self.containers.append(started)
        if self.driver_branch >= 615:
            await self.cap_at_start(started)
        return started

    async def cap_at_start(self, container: Container) -> None:
        """What the node agent's NRI plugin asks at StartContainer on a driver-capped node, answered by the agent's own
        creation gate: the container's v2 leaf capped at its grant (0 on every device for one that names GPUs without
        a grant), read back through nvmlDeviceGetMemoryLimits_v1."""
        driver, mount = Nvml(str(self.gpu.nvml)), creation.v2_mount()
        assert creation.detect_mode(driver, mount) is creation.NodeMode.DRIVER_CAPPED, "the R615 fake offers no per-cgroup limits here"
        gate = creation.CreationGate(self.root / DEFAULT_GRANT_DIR.lstrip("/"), creation.NodeMode.DRIVER_CAPPED, driver=driver, mount=mount)
        ref = container.pod_ref
        request = creation.CreationRequest(event="start", pod_uid=ref.uid, namespace=ref.namespace, pod=ref.name, container=container.name,
                                           env=[f"{name}={value}" for name, value in container.env.items()], pid=container.process.pid)
        try:
            reply = await gate.decide(request)
        finally:
            driver.close()
        assert reply.allow, reply.reason

    def write_grant(self, pod: Obj, container: str, limit: str) -> Path:
        """The grant the node agent writes (root-owned, 0444) before the container starts."""
        meta = pod["metadata"]
        directory = self.root / DEFAULT_GRANT_DIR.lstrip("/") / f"{meta['uid']}_{container}"
        directory.mkdir(parents=True, exist_ok=True)
        grant = Grant(pod_uid=meta["uid"], namespace=meta["namespace"], pod=meta["name"], container=container,
                      devices=(DeviceGrant(uuid=FAKE_GPU_UUID, limit_bytes=parse_limit(limit)),), source=GrantSource.CONFIGMAP)
        path, partial = directory / GRANT_FILE, directory / f".{GRANT_FILE}.tmp"
        partial.write_text(grant.model_dump_json())
        partial.chmod(0o444)
        partial.rename(path)  # atomically, as the node agent does: a reader never sees half a grant
        return path

    def inspect(self, request: InspectRequest) -> InspectReply:
        """The node agent's answer to an inspect request, computed as the agent computes it."""
        return observe.reply_to(self.layout, Path("/proc"), request, NODE, install.active_version(self.layout))

    def driver_stats(self, device: int = 0) -> dict[str, int]:
        """The ledger's node-wide counters for a physical device (dead processes released): `used` and
        `peak` by the cuMemAlloc family, `reserved` by the driver outside it (contexts, limits, modules)."""
        return self.gpu.stats(device)

    def driver_used(self, device: int = 0) -> int:
        """Bytes every process on the node really allocated on `device`: the attack's ground truth."""
        return self.driver_stats(device)["used"]

    async def stop(self) -> None:
        try:
            for program in self.background:
                await program.stop()
            for container in self.containers:
                await container.process.stop()
            await asyncio.to_thread(self.placement.remove)
        finally:
            self.gpu.stop()
