"""A GPU that KAI shares is for its grant holders only (issue 45), tried on the real node as a tenant would.

Beside a GPU-sharing neighbour holding 1 GiB through the library, a plain pod (no GPU share, no `nvidia.com/gpu`, the
default scheduler) names the shared GPU in `NVIDIA_VISIBLE_DEVICES` (`all`, or its UUID): the node's `nvidia` runtime
hands it the driver, as nvidia-container-runtime's env-var device list does, and `rawelf` takes 10 GiB through the raw
driver, which no library sees. At the shipped defaults (webhook `warn`, the node agent's enforcer as users run it) the
pod is admitted with a warning and its process is killed, and the neighbour keeps its memory; under `--policy enforce`
the API server refuses the pod; a host process on the same GPU, outside the kubelet's cgroups, is left alone. The fake
driver's node-wide ledger is the judge. Each attack adds its row (ledger peak, time over the grant) to the table.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from kai_isolator.services.admission import dev as admission_dev
from kai_isolator.services.dev import DevContext
from kai_isolator.services.devcluster.fake_gpu_ledger import FAKE_CONTEXT_OVERHEAD_BYTES
from kai_isolator.services.devcluster.kai import fake_gpu_uuid
from kai_isolator.services.nodeagent.agent import NodeAgent
from kai_isolator.shared.operator_view import ISOLATED_CONDITION
from support import run_summary
from support.pods import cuda_pod
from support.real_node import HAMI_BUILD, LedgerWatch, Node, isolated, ledger
from support.waiting import until

GIB, MIB = 1 << 30, 1 << 20
TAKEN = 10 * GIB
SHARED_GPU = fake_gpu_uuid(0)  # the node's one GPU, which KAI's reservation pod holds once the neighbour is bound
VENV_BIN = Path(sys.executable).parent  # kubectl finds the kubectl-isolator plugin on PATH
ENFORCING = "kai-resource-isolator-enforce"
DENIAL = "kai-resource-isolator denies this pod, which shares no GPU"
ATTACKS = {"NVIDIA_VISIBLE_DEVICES=all": "all", "NVIDIA_VISIBLE_DEVICES=<shared GPU UUID>": SHARED_GPU}
SECTION = "attacks on the real node at the shipped defaults (tests/security/real_node)"
HEADER = f"{'attack':<66} {'ledger peak':>12} {'over the grant':>15}  verdict"


@pytest.fixture(scope="module")
def guarded(real_node_session: Node, cuda_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevContext]:
    """Our webhook, watcher, verifier and node agent beside the real node, all at their shipped defaults."""
    with isolated(real_node_session, tmp_path_factory.mktemp("guarded")) as ctx:
        yield ctx


def plain_pod(name: str, image: str, devices: str) -> dict[str, Any]:
    """What the tenant writes: no gpu-fraction or gpu-memory, no nvidia.com/gpu, the default scheduler, one variable."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
                "name": "cuda", "image": image, "imagePullPolicy": "Never", "command": ["sleep", "infinity"],
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": devices}]}]}}


def neighbour_holds_its_gib(node: Node, image: str, agent: NodeAgent) -> None:
    """The seed's setup: a GPU-sharing pod (gpu-memory 2048) holding 1 GiB through the library; KAI's reservation pod for
    its GPU group holds GPU 0, which makes it shared, as the node agent sees it."""
    node.apply_pod(cuda_pod("neighbour", image, 2048, ["cuprobe", "init", "ctx", "0", "alloc", str(GIB), "hold", "3600000"]))
    node.wait_running("neighbour", timeout_s=120)
    until("the neighbour holds its 1 GiB", lambda: "holding" in node.kubectl("logs", "neighbour"), 30)
    assert agent.grants is not None
    until("the node agent knows GPU 0 is shared", lambda: SHARED_GPU in agent.grants.shared_gpus(), 30)  # type: ignore[union-attr]


def neighbour_kept_its_memory(node: Node, besides: int | None = None) -> None:
    """Still running, never restarted, and on the GPU its GiB and its context, and nothing else (but `besides`)."""
    assert "holding" in node.kubectl("logs", "neighbour")
    status = node.pod("neighbour")["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and "running" in status["state"], status
    held = {pid: used for pid, used in ledger(node).processes(0).items() if pid != besides}
    assert sorted(held.values()) == [GIB + FAKE_CONTEXT_OVERHEAD_BYTES], held


def take_through_the_raw_driver(node: Node, pod: str) -> subprocess.CompletedProcess[str]:
    """`kubectl exec <pod> -- rawelf 10737418240 20000`: cuMemAlloc_v2 found by a raw ELF lookup, held for 20 s unless
    killed (exit 137)."""
    return node.plane.kubectl("exec", pod, "--", "rawelf", str(TAKEN), "20000", check=False, timeout_s=60)


def breach_shown(node: Node, pod: str) -> str:
    """The pod's condition, written by the verifier from the node agent's `breached` verdict, once there."""
    conditions = node.pod(pod)["status"].get("conditions") or []
    return next((c["message"] for c in conditions if c["type"] == ISOLATED_CONDITION and c["message"].startswith("breached")), "")


def kubectl_isolator(node: Node, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "KUBECONFIG": str(node.plane.admin_kubeconfig)}
    return subprocess.run([str(node.plane.binaries.kubectl), "isolator", *args], capture_output=True, text=True, env=env, timeout=30)


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_plain_pod_naming_the_shared_gpu_is_killed_and_the_neighbour_keeps_its_memory(
        guarded: DevContext, real_node: Node, cuda_image: str, attack: str) -> None:
    node, agent = real_node, guarded.values["agent"]
    neighbour_holds_its_gib(node, cuda_image, agent)
    name = "plain-all" if ATTACKS[attack] == "all" else "plain-uuid"
    applied = node.plane.kubectl("apply", "-f", "-", input_text=json.dumps(plain_pod(name, cuda_image, ATTACKS[attack])))
    node.made.append(("default", name))
    # Shipped defaults: admitted, with the finding as a warning (the webhook saw it: its matchConditions send it such pods).
    assert "kai-resource-isolator: container cuda sets NVIDIA_VISIBLE_DEVICES but asks for no nvidia.com/gpu" in applied.stderr, applied
    node.wait_running(name, timeout_s=120)

    with LedgerWatch(ledger(node), over=TAKEN) as watch:
        attack_run = take_through_the_raw_driver(node, name)
    assert f"alloc {TAKEN} rc=0" in attack_run.stdout, attack_run  # the driver gave it 10 GiB: the node's runtime let it in
    assert attack_run.returncode == 137, attack_run  # SIGKILLed by the enforcer, not ended by itself after 20 s
    neighbour_kept_its_memory(node)

    message = until("the verifier shows the breach on the pod", lambda: breach_shown(node, name), 60)
    assert "container cuda: over-grant" in message and "held to 0 bytes" in message and SHARED_GPU in message, message
    events = json.loads(node.kubectl("get", "events", "--field-selector", f"involvedObject.name={name},reason=IsolationBreached",
                                     "-o", "json"))["items"]
    assert [e["source"]["component"] for e in events] == ["kai-isolator-nodeagent"], events
    killed = agent.runtime.metrics.registry.get_sample_value(
        "kai_isolator_breaches_total", {"namespace": "default", "pod": name, "container": "cuda", "action": "killed"})
    assert killed == 1
    listed = kubectl_isolator(node, "status", "-n", "default", "-o", "json")
    rows = {(r["pod"], r["container"]): r for r in json.loads(listed.stdout)["items"]}
    assert listed.returncode == 3 and rows[(name, "cuda")]["verdict"] == "breached", listed  # shown by namespace and pod
    run_summary.add(SECTION, f"{'plain pod, ' + attack + ', 10 GiB raw':<66} {watch.peak >> 20:>8} MiB "
                             f"{watch.over_s or 0.0:>13.2f} s  breached: over-grant, killed (held to 0)", header=HEADER)


def test_a_host_process_on_the_shared_gpu_is_left_alone(guarded: DevContext, real_node: Node, cuda_image: str) -> None:
    """A process outside every kubelet pod cgroup (a DCGM exporter, the persistence daemon) is the host's: reported as
    unattributed on every poll, never touched."""
    node, agent = real_node, guarded.values["agent"]
    neighbour_holds_its_gib(node, cuda_image, agent)
    assert node.real.gpu is not None and agent.enforcer is not None
    host = subprocess.Popen([str(HAMI_BUILD / "tests" / "cuprobe"), "init", "ctx", "0", "alloc", str(2 * GIB), "hold", "600000"],
                            env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(node.real.gpu.driver)}, stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        said = until_holding(host.stdout)
        assert f"alloc {2 * GIB} rc=0" in "".join(said), said
        began = time.monotonic()
        seen: set[float] = set()  # the complete polls, taken after it held its memory, that listed it and left it

        def three_polls_left_it() -> bool:
            last = agent.enforcer.last  # type: ignore[union-attr]
            if last is not None and last.ok and last.at > began and host.pid in {u.pid for u in last.unattributed}:
                seen.add(last.at)
            return len(seen) >= 3

        until("three complete polls see the host process and leave it", three_polls_left_it, 30)
        why = {u.pid: u.why for u in agent.enforcer.last.unattributed}  # type: ignore[union-attr]
        assert why.get(host.pid) == "not in a kubelet container cgroup", why
        assert host.poll() is None and ledger(node).processes(0).get(host.pid) == 2 * GIB + FAKE_CONTEXT_OVERHEAD_BYTES
        neighbour_kept_its_memory(node, besides=host.pid)
    finally:
        host.kill()
        host.wait()


def until_holding(output: IO[str]) -> list[str]:
    """What cuprobe says before `holding`, read as it says it."""
    said = []
    for line in output:
        if line.startswith("holding"):
            return said
        said.append(line)
    raise AssertionError(f"cuprobe ended before it held its memory: {said}")


@contextlib.contextmanager
def enforcing_webhook(node: Node, guarded: DevContext) -> Iterator[None]:
    """A second webhook of ours, under `--policy enforce`, registered beside the shipped one for the length of a test."""
    cluster = node.real.cluster
    assert cluster is not None
    workdir = guarded.workdir / "enforce"
    workdir.mkdir(exist_ok=True)
    enforcing = DevContext(nats_url=guarded.nats_url, bus=guarded.bus, workdir=workdir, values={"policy": "enforce"})

    @contextlib.asynccontextmanager
    async def registered() -> AsyncIterator[None]:
        async with admission_dev.component(enforcing):
            await cluster.register_webhook(enforcing.values["admission_url"], enforcing.values["admission_ca_bundle"], name=ENFORCING,
                                           failure_policy="Fail")
            try:
                yield
            finally:
                await cluster.unregister_webhook(ENFORCING)

    running = registered()
    node.loop.run(running.__aenter__(), 60)
    try:
        yield
    finally:
        node.loop.run(running.__aexit__(None, None, None), 60)


def refused(node: Node, pod: dict[str, Any], *flags: str) -> str:
    """Our denial, when the API server refuses the pod; "" when it creates it."""
    done = node.plane.kubectl("apply", *flags, "-f", "-", input_text=json.dumps(pod), check=False)
    return done.stderr if done.returncode != 0 and DENIAL in done.stderr else ""


def test_under_enforce_the_same_pods_are_refused_at_admission(guarded: DevContext, real_node: Node, cuda_image: str) -> None:
    node = real_node
    with enforcing_webhook(node, guarded):
        # The API server takes up a new registration from a watch, not at once: ask until the enforcing webhook answers.
        until("the enforcing webhook is in force", lambda: refused(node, plain_pod("plain-all", cuda_image, "all"), "--dry-run=server"), 30)
        for name, devices in (("plain-all", "all"), ("plain-uuid", SHARED_GPU)):
            denial = refused(node, plain_pod(name, cuda_image, devices))
            assert "container cuda sets NVIDIA_VISIBLE_DEVICES but asks for no nvidia.com/gpu" in denial, denial
            assert node.kubectl("get", "pod", name, "--ignore-not-found", "-o", "name").strip() == ""
            shown = "all" if devices == "all" else "<shared GPU UUID>"
            run_summary.add(SECTION, f"{'plain pod, NVIDIA_VISIBLE_DEVICES=' + shown + ', --policy enforce':<66} {'-':>12} {'-':>15}  "
                                     "refused at admission", header=HEADER)
        # Asking the runtime for no GPU is no finding: such a pod is admitted.
        assert not refused(node, plain_pod("plain-void", cuda_image, "void"), "--dry-run=server")
