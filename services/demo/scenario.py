"""`kai-isolator dev --demo`: the seed's example end to end, printed as a readable timeline. DEMO.

A GPU-sharing pod (`gpu-memory: "4096"` on a 15360 MiB T4) is admitted, scheduled with
`CUDA_DEVICE_MEMORY_LIMIT=4147m`, started as a real process in a private mount namespace
allocating through the fake driver, and verified; then an opted-out pod and a pod admitted
while the webhook was down are caught; last, a tenant that bypasses the library with a raw
driver lookup is killed by the node agent's enforcer while its neighbour keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes_asyncio import client, config

from kai_isolator.shared.contract import GPU_MEMORY_ANNOTATION, GRANT_VOLUME, INJECT_ANNOTATION, LIMIT_ENV, VGPU_VOLUME
from kai_isolator.shared.errors import IsolatorError
from kai_isolator.shared.events import AdmissionDecision, GrantDecision, HealthVerdict, NodeStatus, Payload, PodIsolation
from kai_isolator.shared.limits import parse_limit
from kai_isolator.shared.tail import follow
from kai_isolator.shared.tasks import cancel_all

from .kubelet import CgroupPlacement, ContainerProcess, new_container_id, start_container

if TYPE_CHECKING:
    from kai_isolator.services.dev import DevContext

HAMI_BUILD = Path(__file__).resolve().parents[2] / "hami-core" / "build"
CUDA_PROGRAM = HAMI_BUILD / "tests" / "cuprobe"  # a small CUDA driver client, stand-in for a training job
NVIDIA_SMI = HAMI_BUILD / "tests" / "nvsmi"  # queries NVML as nvidia-smi does
RAW_LOOKUP = HAMI_BUILD / "tests" / "rawelf"  # a tenant's bypass: cuMemAlloc_v2 found by a raw ELF lookup
NAMESPACE = "default"
WEBHOOK = "kai-resource-isolator"  # as the local control plane's dev component registers it
NODE = "gpu-node-1"
GIB = 1 << 30
CUDA_ERRORS = {"0": "CUDA_SUCCESS", "2": "CUDA_ERROR_OUT_OF_MEMORY"}


class DemoFailed(IsolatorError):
    """A step of the walk-through did not happen in time."""


def say(who: str, text: str) -> None:
    print(f"  [{who:>9}] {text}", flush=True)


class BusLog:
    """Every event published since the demo began, to wait on."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events: list[Payload] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> BusLog:
        self._task = asyncio.create_task(self._collect(datetime.now(timezone.utc)))
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        await cancel_all([self._task])

    async def _collect(self, since: datetime) -> None:
        async for item in follow(self.url, since=since):
            if item.payload is not None:
                self.events.append(item.payload)
                self._changed.set()

    async def wait_for(self, what: str, match: Callable[[Payload], bool], timeout_s: float = 30) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            found = next((e for e in self.events if match(e)), None)
            if found is not None:
                return found
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DemoFailed(f"timed out waiting for {what}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)


def is_injected(pod: dict[str, Any]) -> bool:
    return any(v.get("name") == VGPU_VOLUME for v in (pod.get("spec") or {}).get("volumes") or [])


def demo_pod(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "annotations": {GPU_MEMORY_ANNOTATION: "4096", **annotations}},
        "spec": {
            "schedulerName": "kai-scheduler",
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            # The webhook's policy wants a seccomp profile: Unconfined would let the tenant unshare a user namespace.
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "main", "image": "nvcr.io/nvidia/pytorch:24.01-py3", "command": ["python", "train.py"]}],
        },
    }


class Demo:
    def __init__(self, ctx: DevContext, api: client.ApiClient, bus: BusLog) -> None:
        self.ctx = ctx
        self.core = client.CoreV1Api(api)
        self.bus = bus
        self.containers: list[ContainerProcess] = []
        self.scratch = ctx.workdir / "demo"
        self.cgroups = CgroupPlacement()

    async def run(self) -> None:
        await self.library_installed()
        await self.isolated_pod()
        await self.opted_out_pod()
        await self.pod_admitted_while_webhook_down()
        await self.library_bypassed()
        await self.operator_view()

    async def library_installed(self) -> None:
        status: NodeStatus = await self.bus.wait_for(
            "the node agent's status", lambda e: isinstance(e, NodeStatus) and e.node_name == NODE and e.active_version is not None)
        say("node", f"libvgpu.so {status.active_version} installed on {NODE} under {status.container_vgpu_mount} (self-check {status.self_check})")

    async def isolated_pod(self) -> None:
        print("\n1. the seed's example: gpu-memory \"4096\" on a 15360 MiB T4", flush=True)
        pod = await self.create(demo_pod("gpu-sharing-demo", {}))
        limit = await self.scheduled(pod)
        await self.granted(pod)
        container = await self.start(pod)
        for _ in range(2):
            say("container", self.describe(await container.read_line()))
        allocated = await container.read_line()
        say("container", f"cuMemAlloc 1 GiB: {self.result(allocated)}")
        info = dict(field.split("=") for field in (await container.read_line()).split()[2:])
        say("container", f"cuMemGetInfo: {int(info['free']) >> 20} MiB free of {int(info['total']) >> 20} MiB")
        smi = (await container.exec([str(NVIDIA_SMI)])).strip().splitlines()[-1]
        say("container", f"nvidia-smi inside the container: {smi}")
        over = await container.read_line()
        say("container", f"cuMemAlloc {self.over_limit_bytes(limit) / GIB:.2f} GiB more (past {limit}): {self.result(over)}")
        await self.verdict(pod, "verified")

    async def opted_out_pod(self) -> None:
        print("\n2. a pod that opted out (kai-resource-isolator.io/inject: \"false\")", flush=True)
        pod = await self.create(demo_pod("opted-out", {INJECT_ANNOTATION: "false"}))
        await self.scheduled(pod)
        await self.start(pod)
        await self.verdict(pod, "missing")

    async def pod_admitted_while_webhook_down(self) -> None:
        print("\n3. a pod admitted while the webhook was unreachable (failurePolicy Ignore)", flush=True)
        hooks = client.AdmissionregistrationV1Api(self.core.api_client)
        real_url = self.ctx.values["admission_url"]
        await self.point_webhook_at(hooks, "https://127.0.0.1:9/mutate", reachable=False)
        say("operator", "webhook Service down: the API server cannot reach https://127.0.0.1:9/mutate")
        try:
            pod = await self.create(demo_pod("webhook-was-down", {}))
        finally:
            await self.point_webhook_at(hooks, real_url, reachable=True)
        limit = await self.scheduled(pod)
        container = await self.start(pod)
        await self.show_unenforced(container, limit)
        await self.verdict(pod, "missing")
        if self.ctx.values.get("fake_driver_env"):  # the node agent sees this node's (fake) driver: it enforces too
            await self.breached(pod)
        events = await self.core.list_namespaced_event(NAMESPACE)
        for event in events.items:
            if event.involved_object.name == pod["metadata"]["name"] and (event.reason or "").startswith("Isolation"):
                say("kubectl", f"describe pod {pod['metadata']['name']}: {event.type} {event.reason} {event.message}")

    async def library_bypassed(self) -> None:
        print("\n4. a tenant bypasses the library with a raw lookup of the driver's cuMemAlloc_v2", flush=True)
        neighbour = self.containers[0]  # the first pod's container, still holding its 1 GiB
        # KAI books 4096 MiB per pod on the card (0.27 of it): a T4 holds three such shares, so one goes first.
        await self.core.delete_namespaced_pod("opted-out", NAMESPACE, grace_period_seconds=0)
        say("operator", "deleted opted-out: KAI books 4096 MiB for each pod and a 15360 MiB T4 holds three, so bypass-demo needs its place")
        pod = await self.create(demo_pod("bypass-demo", {}))
        limit = await self.scheduled(pod)
        await self.granted(pod)
        past = parse_limit(limit) + GIB // 2
        container = await self.start(pod, [str(RAW_LOOKUP), str(past)])
        say("container", f"raw-ELF cuMemAlloc_v2 of {past / GIB:.2f} GiB (past {limit}): {self.result(await container.read_line())} "
                         "(the library never saw the call)")
        await self.breached(pod)
        await asyncio.wait_for(container.process.wait(), 10)
        for event in (await self.core.list_namespaced_event(NAMESPACE)).items:
            if event.involved_object.name == "bypass-demo" and event.reason == "IsolationBreached":
                say("kubectl", f"describe pod bypass-demo: {event.type} {event.reason} {event.message[:160]}...")
        if neighbour.process.returncode is not None:
            raise DemoFailed("the neighbour of the breaching pod stopped")
        say("container", f"gpu-sharing-demo (same GPU): still running, pid {neighbour.pid}, its memory untouched")

    async def operator_view(self) -> None:
        """`kubectl isolator status -A` and `nodes`, run as an operator would, on the Kubernetes API alone."""
        print("\n5. what an operator sees: kubectl isolator status -A, then nodes", flush=True)
        for command in (["status", "-A"], ["nodes"]):
            code, out = await self.kubectl_isolator(command)
            for line in out.rstrip().splitlines():
                print(f"  {line}", flush=True)
            say("kubectl", f"isolator {' '.join(command)}: exit code {code}" + (" (some container is missing or breached)" if code == 3 else ""))

    async def kubectl_isolator(self, command: list[str]) -> tuple[int, str]:
        plugin = Path(sys.executable).parent / "kubectl-isolator"  # the console script installed with the package
        process = await asyncio.create_subprocess_exec(
            str(plugin), *command, "--kubeconfig", str(self.ctx.values["kubeconfig"]),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
        out, _ = await asyncio.wait_for(process.communicate(), 30)
        return process.returncode or 0, out.decode()

    # --- steps ----------------------------------------------------------------------------

    async def point_webhook_at(self, hooks: client.AdmissionregistrationV1Api, url: str, *, reachable: bool) -> None:
        await self.until_registered()
        patch = [{"op": "replace", "path": "/webhooks/0/clientConfig/url", "value": url}]
        await hooks.patch_mutating_webhook_configuration(WEBHOOK, patch)
        await self.until_in_force(injected=reachable)

    async def until_registered(self, timeout_s: float = 30) -> None:
        """The local control plane registers our webhook once the webhook serves (dev.register_admission_when_ready): a
        step that changes the registration waits for it, whichever step runs first."""
        deadline = time.monotonic() + timeout_s
        while not self.ctx.values.get("webhook_registered"):
            if time.monotonic() > deadline:
                raise DemoFailed(f"the webhook was not registered with the API server within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    async def until_in_force(self, *, injected: bool, timeout_s: float = 30) -> None:
        """The API server takes a changed webhook configuration up from a watch, not at once (seconds, on a loaded
        machine): a dry-run pod, which the webhook does not publish, shows when it has."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = await self.core.create_namespaced_pod(NAMESPACE, demo_pod("webhook-probe", {}), dry_run="All", _preload_content=False)
            if is_injected(await answer.json()) == injected:
                return
            if time.monotonic() > deadline:
                raise DemoFailed(f"the webhook's new address was not in force {timeout_s:.0f}s after the change")
            await asyncio.sleep(0.2)

    async def show_unenforced(self, container: ContainerProcess, limit: str) -> None:
        lines = [await container.read_line() for _ in range(5)]
        say("container", f"no library: cuMemAlloc 1 GiB + {self.over_limit_bytes(limit) / GIB:.2f} GiB past {limit}: {self.result(lines[4])} (the whole card is open)")

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        created = await self.core.create_namespaced_pod(NAMESPACE, body, _preload_content=False)
        pod = await created.json()
        decision: AdmissionDecision | None = None
        with contextlib.suppress(DemoFailed):
            decision = await self.bus.wait_for(
                "the admission decision", lambda e: isinstance(e, AdmissionDecision) and e.pod_name == name, timeout_s=3)
        if decision is None and is_injected(pod):  # its decision is on its way (the bus may be failing over)
            say("admission", f"{NAMESPACE}/{name}: injected (its decision has not reached the bus yet)")
        elif decision is None:
            say("admission", f"{NAMESPACE}/{name}: the webhook never saw it (unreachable, failurePolicy Ignore let it through)")
        else:
            detail = f" into container {decision.container} ({decision.patch_operations} patch operations)" if decision.decision == "injected" else ""
            say("admission", f"{NAMESPACE}/{name}: {decision.decision}{detail}{': ' + decision.reason if decision.reason else ''}")
        return pod

    async def scheduled(self, pod: dict[str, Any]) -> str:
        name = pod["metadata"]["name"]
        event: PodIsolation = await self.bus.wait_for(
            "the pod to be scheduled", lambda e: isinstance(e, PodIsolation) and e.pod.name == name and e.state == "scheduled")
        say("scheduler", f"{name} bound to {event.node_name} with CUDA_DEVICE_MEMORY_LIMIT={event.expected_limit} (injected: {event.injected})")
        return event.expected_limit or ""

    async def granted(self, pod: dict[str, Any]) -> GrantDecision:
        name = pod["metadata"]["name"]
        grant: GrantDecision = await self.bus.wait_for(
            "the node agent's grant", lambda e: isinstance(e, GrantDecision) and e.pod.name == name and e.outcome == "written")
        devices = ", ".join(grant.devices)
        say("nodeagent", f"{name}: grant.json written for container {grant.container}: {(grant.limit_bytes or 0) >> 20} MiB on {devices} "
                         f"(from the {grant.source}, read-only at /etc/kai-isolator)")
        return grant

    async def start(self, pod: dict[str, Any], argv: list[str] | None = None) -> ContainerProcess:
        name = pod["metadata"]["name"]
        current = await self.report_container_id(name)
        container_spec = current["spec"]["containers"][0]
        configmaps = await self.configmaps(container_spec)
        limit = next((v[LIMIT_ENV] for v in configmaps.values() if LIMIT_ENV in v), "0")
        argv = argv or [str(CUDA_PROGRAM), "init", "ctx", "0", "alloc", str(GIB), "info", "alloc", str(self.over_limit_bytes(limit)),
                        "waitfile", str(self.scratch / f"{name}.stop")]
        process = await start_container(
            current, container_spec, argv, configmaps=configmaps, host_root=Path(self.ctx.values["host_root"]),
            scratch=self.scratch / name, extra_env={"LD_LIBRARY_PATH": str(HAMI_BUILD / "fake"), **self.ctx.values.get("fake_driver_env", {})},
            placement=self.cgroups,
        )
        self.containers.append(process)
        preload = (await process.exec(["sh", "-c", "cat /etc/ld.so.preload 2>/dev/null"])).strip() or "(none)"
        say("kubelet", f"{name}: container main started, pid {process.pid}, private mount namespace; /etc/ld.so.preload: {preload}")
        return process

    async def breached(self, pod: dict[str, Any]) -> HealthVerdict:
        """The node agent's enforcer: the driver's view of the pod above its grant, and what it did."""
        name = pod["metadata"]["name"]
        verdict: HealthVerdict = await self.bus.wait_for(
            f"the enforcer's breached verdict on {name}", lambda e: isinstance(e, HealthVerdict) and e.pod.name == name and e.verdict == "breached")
        if verdict.breach is None:
            raise DemoFailed("a breached verdict without its breach")
        killed = ", ".join(str(p.pid) for p in verdict.breach.processes if p.killed) or "none"
        say("nodeagent", f"{name}: the driver (NVML) shows {verdict.breach.measured_bytes >> 20} MiB held, grant "
                         f"{verdict.breach.grant_bytes >> 20} MiB: {verdict.breach.action} pid {killed}")
        say("verdict", f"{name}: {verdict.verdict.upper()} ({', '.join(r.code for r in verdict.reasons)}), on isolator.health beside the verifier's")
        return verdict

    async def report_container_id(self, name: str) -> dict[str, Any]:
        """As a kubelet does: the runtime's id of the container in the pod's status (the node agent
        maps a process's kubelet cgroup to the container by it). Returns the pod as it now is."""
        deadline = time.monotonic() + 30
        while True:  # after the simulated kubelet has marked it Running, so its own statuses do not replace ours
            current = await (await self.core.read_namespaced_pod(name, NAMESPACE, _preload_content=False)).json()
            if (current.get("status") or {}).get("phase") == "Running" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        statuses = (current.get("status") or {}).get("containerStatuses") or [{"name": c["name"]} for c in current["spec"]["containers"]]
        status = {**(current.get("status") or {}), "containerStatuses": [
            {**s, "containerID": f"containerd://{new_container_id()}"} for s in statuses]}
        patched = await self.core.patch_namespaced_pod_status(name, NAMESPACE, {"status": status}, _preload_content=False)
        return await patched.json()

    async def verdict(self, pod: dict[str, Any], expected: str) -> HealthVerdict:
        """Wait for the pod's verdict; `verified` stands for what a healthy pod gets (see `healthy`)."""
        name = pod["metadata"]["name"]
        verdict: HealthVerdict = await self.bus.wait_for(
            f"the verifier's verdict on {name}", lambda e: isinstance(e, HealthVerdict) and e.pod.name == name and e.verdict != "breached")
        reasons = ", ".join(r.code for r in verdict.reasons) or "preload active, library mapped, limit matches"
        say("verifier", f"{name}: {verdict.verdict.upper()} ({reasons})")
        wanted, codes = self.healthy(pod) if expected == "verified" else (expected, None)
        if verdict.verdict != wanted or (codes is not None and [r.code for r in verdict.reasons] != codes):
            raise DemoFailed(f"{name} was judged {verdict.verdict} ({reasons}), expected {wanted}")
        return verdict

    @staticmethod
    def healthy(pod: dict[str, Any]) -> tuple[str, list[str]]:
        """The verdict and reasons of a well-behaved injected pod: `verified` when the webhook mounts
        the node-written grant; without one its limit comes from the environment the tenant controls."""
        if any(v.get("name") == GRANT_VOLUME for v in (pod.get("spec") or {}).get("volumes") or []):
            return "verified", []
        return "degraded", ["limit-from-env"]

    async def configmaps(self, container: dict[str, Any]) -> dict[str, dict[str, str]]:
        found = {}
        for item in container.get("env") or []:
            ref = (item.get("valueFrom") or {}).get("configMapKeyRef")
            if ref:
                with contextlib.suppress(client.ApiException):
                    found[ref["name"]] = (await self.core.read_namespaced_config_map(ref["name"], NAMESPACE)).data or {}
        return found

    @staticmethod
    def over_limit_bytes(limit: str) -> int:
        """An allocation that, after the first GiB, crosses the limit by about half a GiB."""
        return max(parse_limit(limit) if limit else 0, GIB) - GIB + GIB // 2

    @staticmethod
    def result(line: str) -> str:
        code = line.split("rc=", 1)[1].split()[0] if "rc=" in line else "?"
        return CUDA_ERRORS.get(code, f"CUresult {code}")

    @staticmethod
    def describe(line: str) -> str:
        return {"init rc=0": "cuInit: CUDA_SUCCESS", "ctx rc=0": "cuDevicePrimaryCtxRetain + cuCtxSetCurrent: CUDA_SUCCESS"}.get(line, line)

    async def stop(self) -> None:
        for container in self.containers:
            await container.stop()
        await asyncio.to_thread(self.cgroups.remove)


@contextlib.asynccontextmanager
async def kubernetes(kubeconfig: Path) -> AsyncIterator[client.ApiClient]:
    api = await config.new_client_from_config(config_file=str(kubeconfig))
    try:
        yield api
    finally:
        await api.close()


async def run_demo(ctx: DevContext) -> int:
    print(f"kai-isolator demo: real kube-apiserver (KAI and the kubelet simulated), webhook, watcher, node agent, verifier on {ctx.nats_description}", flush=True)
    async with kubernetes(Path(ctx.values["kubeconfig"])) as api, BusLog(ctx.nats_url) as bus:
        demo = Demo(ctx, api, bus)
        try:
            await demo.run()
        except IsolatorError as error:
            print(f"\ndemo FAILED: {error}", flush=True)
            return 1
        finally:
            await demo.stop()
    print("\ndemo complete: isolation enforced where injected, and caught where it was not", flush=True)
    return 0
