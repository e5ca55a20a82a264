"""The grant held at container creation (issue 41), on the real node, with the node agent's NRI plugin registered with
the node's containerd 2.4 as a GPU Operator node runs it, for both kinds of driver the fake GPU can be:

- 615 (NVML 13.4's per-cgroup memory limits): the node is `driver-capped`; the seed's pod (gpu-memory 4096, a 4147 MiB
  grant) asking the raw driver for 8 GiB gets CUDA_ERROR_OUT_OF_MEMORY from the driver at the grant, nothing is killed,
  and the node-wide ledger never holds more than the grant;
- 580 (no limits): the node is `library-and-enforcer`; the same attack is caught by the enforcer, as before.

On either: a container whose grant is not written yet waits and then starts with it; a tenant's own
NVIDIA_GPU_MEMORY_LIMIT is replaced by the grant's; with the agent down a GPU-sharing container is not created (the
plugin fails closed), and with the plugin gone too the pod's `required-plugins` annotation (the webhook's) keeps it from
being created. The fake driver's ledger is the judge; each kind adds its row to the run's summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kai_isolator.services.dev import DevContext
from kai_isolator.services.devcluster import build
from kai_isolator.services.nodeagent import grant_files
from kai_isolator.services.nodeagent.agent import NodeAgent
from support import run_summary
from support.pods import cuda_pod
from support.real_node import SEED_POD, SEED_POD_NAME, LedgerWatch, Node, isolated, ledger
from support.waiting import until

GIB, MIB = 1 << 30, 1 << 20
ASKED = 8 * GIB
SEED_GRANT_MIB = 4147  # gpu-memory 4096 and the context's share, as the seed's nvidia-smi shows it
MODES = {580: "library-and-enforcer", 615: "driver-capped"}
SECTION = "the grant held at creation on the real node (tests/security/real_node/test_driver_cap.py)"
HEADER = f"{'driver':<8} {'mode':<22} {'attack':<34} {'ledger peak':>12} {'over the grant':>15}  outcome"


@pytest.fixture(scope="module")
def held(request: pytest.FixtureRequest, real_node_session: Node, cuda_image: str,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevContext]:
    """The node's driver switched to the parameter's branch, then our services with the agent's NRI plugin registered."""
    node = real_node_session
    node.real.switch_driver(request.param)
    try:
        with isolated(node, tmp_path_factory.mktemp(f"nri-{request.param}"), nri=True) as ctx:
            ctx.values["branch"] = request.param
            yield ctx
    finally:
        node.real.switch_driver(580)  # the session's other modules run on the default driver


def grant_mib(agent: NodeAgent, node: Node, pod: str) -> int:
    uid = node.pod(pod)["metadata"]["uid"]
    grant = grant_files.read_grant(agent.grant_root, uid, "cuda")
    assert grant is not None, f"no grant for {pod}"
    return grant.devices[0].limit_bytes // MIB


def container_env(node: Node, pod: str) -> dict[str, str]:
    """The container's environment as its processes get it (the OCI spec's, which `kubectl exec` inherits)."""
    return dict(line.split("=", 1) for line in node.kubectl("exec", pod, "--", "env").splitlines() if "=" in line)


def verdicts_held(nats_url: str, pod: str) -> list[str]:
    """What every verdict on `pod` so far says of how it is held, read as users read it (`kai-isolator events`)."""
    read = subprocess.run(["timeout", "8", sys.executable, "-m", "kai_isolator.services.cli", "events", "--nats-url", nats_url,
                           "--since", "1h", "--json", "--subject", "isolator.health.>"], capture_output=True, text=True, timeout=30)
    events = [json.loads(line) for line in read.stdout.splitlines() if line.startswith("{")]
    return [e["data"]["held"] for e in events if e["subject"] == f"default/{pod}" and e["data"].get("held")]


def waiting_reason(node: Node, pod: str) -> str:
    """`<reason>: <message>` of the pod's waiting container, or "" while it is not waiting on an error."""
    statuses = node.pod(pod)["status"].get("containerStatuses") or []
    waiting = statuses[0]["state"].get("waiting") if statuses else None
    return f"{waiting['reason']}: {waiting.get('message', '')}" if waiting and waiting.get("message") else ""


@pytest.mark.parametrize("held", [580, 615], indirect=True)
def test_the_seeds_pod_taking_8_gib_from_the_raw_driver(held: DevContext, real_node: Node) -> None:
    node, agent, branch = real_node, held.values["agent"], held.values["branch"]
    assert agent.mode.value == MODES[branch]
    node.kubectl("apply", "-f", "-", input_text=SEED_POD)
    node.made.append(("default", SEED_POD_NAME))
    node.wait_running(SEED_POD_NAME, timeout_s=120)
    assert grant_mib(agent, node, SEED_POD_NAME) == SEED_GRANT_MIB

    with LedgerWatch(ledger(node), over=SEED_GRANT_MIB * MIB) as watch:
        attack = node.plane.kubectl("exec", SEED_POD_NAME, "--", "rawelf", str(ASKED), "3000", check=False, timeout_s=60)
    status = node.pod(SEED_POD_NAME)["status"]["containerStatuses"][0]
    if branch == 615:
        # The driver refused at the grant: CUDA_ERROR_OUT_OF_MEMORY, the process ran on, and nothing was over the grant.
        assert f"alloc {ASKED} rc=2" in attack.stdout and attack.returncode == 0, attack
        assert watch.first_over is None and watch.peak <= SEED_GRANT_MIB * MIB, watch.peak
        killed = agent.runtime.metrics.registry.get_sample_value(
            "kai_isolator_breaches_total", {"namespace": "default", "pod": SEED_POD_NAME, "container": "cuda", "action": "killed"})
        assert not killed
        outcome = "CUDA_ERROR_OUT_OF_MEMORY from the driver, nothing killed"
    else:
        assert f"alloc {ASKED} rc=0" in attack.stdout and attack.returncode == 137, attack  # the enforcer's SIGKILL
        outcome = "allocated, killed by the enforcer"
    assert status["restartCount"] == 0 and "running" in status["state"], status
    smi = node.kubectl("exec", SEED_POD_NAME, "--", "nvidia-smi")
    assert re.search(rf"\| +\d+MiB / +{SEED_GRANT_MIB}MiB \|", smi), smi
    # The verifier's verdict names how the container is held: on R615 the cap it read back on the container's leaf.
    said = until("a verdict on the seed's pod that says how it is held", lambda: verdicts_held(held.nats_url, SEED_POD_NAME), 90)
    assert set(said) == {MODES[branch]}, said
    run_summary.add(SECTION, f"R{branch:<7} {MODES[branch]:<22} {'seed pod, 8 GiB raw (rawelf)':<34} {watch.peak >> 20:>8} MiB "
                             f"{watch.over_s or 0.0:>13.2f} s  {outcome}", header=HEADER)


@contextlib.contextmanager
def grants_held_back(agent: NodeAgent) -> Iterator[asyncio.Event]:
    """The agent's grant writer waits on the yielded event (set it from the agent's loop): a grant not written yet."""
    keeper = agent.grants
    assert keeper is not None
    release = asyncio.Event()
    apply = keeper._apply

    async def later(*args: Any) -> None:
        await release.wait()
        await apply(*args)

    keeper._apply = later  # type: ignore[method-assign]
    try:
        yield release
    finally:
        del keeper._apply  # the class's again


@pytest.mark.parametrize("held", [615], indirect=True)
def test_a_container_whose_grant_is_not_written_yet_waits_then_starts_with_it(held: DevContext, real_node: Node, cuda_image: str) -> None:
    node, agent = real_node, held.values["agent"]
    with grants_held_back(agent) as release:
        node.apply_pod(cuda_pod("late-grant", cuda_image, 2048, ["sleep", "infinity"]))
        reason = until("creation refused while the grant is missing", lambda: waiting_reason(node, "late-grant"), 90)
        assert "no grant yet for default/late-grant container cuda" in reason, reason
        node.loop.loop.call_soon_threadsafe(release.set)
        node.wait_running("late-grant", timeout_s=120)
    granted = grant_mib(agent, node, "late-grant")
    env = container_env(node, "late-grant")
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == str(granted) and env["CUDA_DEVICE_MEMORY_LIMIT"] == f"{granted}m", env


@pytest.mark.parametrize("held", [615], indirect=True)
def test_a_tenants_own_memory_limit_is_replaced_by_the_grant(held: DevContext, real_node: Node, cuda_image: str) -> None:
    node, agent = real_node, held.values["agent"]
    pod = cuda_pod("own-limit", cuda_image, 2048, ["sleep", "infinity"])
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "15360"},
                                           {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=15360M"}]
    node.apply_pod(pod)
    node.wait_running("own-limit", timeout_s=120)
    env = container_env(node, "own-limit")
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == str(grant_mib(agent, node, "own-limit")), env
    # The driver holds the grant, whatever the tenant wrote: 3 GiB of a 2099 MiB grant is refused by the driver itself.
    attack = node.plane.kubectl("exec", "own-limit", "--", "rawelf", str(3 * GIB), "1", check=False, timeout_s=60)
    assert f"alloc {3 * GIB} rc=2" in attack.stdout, attack
    # A tenant variable the grant has no value for is overwritten empty: containerd's NRI (v0.12.3) drops a plugin's
    # removal of a variable the pod spec set, so the agent answers a value for every name it strips.
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "", env


@contextlib.contextmanager
def back_afterwards(node: Node, agent: NodeAgent) -> Iterator[None]:
    """The agent's decision socket and its plugin up again after the block, whatever it took down: the module's other
    tests share this agent and node (pytest may order them after this one)."""
    socket = agent.settings.nri_socket
    assert socket is not None
    try:
        yield
    finally:
        if agent._creation_server is not None:
            node.loop.run(_close(agent._creation_server), 10)
        node.loop.run(agent._serve_creation(socket), 30)
        node.node.stop_nri_plugin()  # a no-op where the block already stopped it
        node.node.start_nri_plugin(build.nri_plugin(), socket)


@pytest.mark.parametrize("held", [615], indirect=True)
def test_with_the_agent_down_no_gpu_sharing_container_is_created(held: DevContext, real_node: Node, cuda_image: str) -> None:
    node, agent = real_node, held.values["agent"]
    with back_afterwards(node, agent):
        agent_and_plugin_down(node, agent, cuda_image)


def agent_and_plugin_down(node: Node, agent: NodeAgent, cuda_image: str) -> None:
    server = agent._creation_server
    assert server is not None
    node.loop.run(_close(server), 10)  # the agent's decision socket gone, as with the agent's pod down
    node.apply_pod(cuda_pod("agent-down", cuda_image, 2048, ["sleep", "infinity"]))
    reason = until("creation refused while the agent is down", lambda: waiting_reason(node, "agent-down"), 90)
    assert "kai-isolator node agent unreachable" in reason and "fail closed" in reason, reason
    # A pod outside GPU sharing never reaches the agent: the node still runs everything else.
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain-while-down", "namespace": "default"},
             "spec": {"terminationGracePeriodSeconds": 1, "containers": [{"name": "c", "image": cuda_image, "imagePullPolicy": "Never",
                                                                           "command": ["sleep", "infinity"], "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]}}
    node.apply_pod(plain)
    node.wait_running("plain-while-down", timeout_s=120)

    # The plugin gone as well: containerd's default validator refuses the container the webhook marked as needing it.
    node.node.stop_nri_plugin()
    node.apply_pod(cuda_pod("plugin-down", cuda_image, 2048, ["sleep", "infinity"]))
    reason = until("creation refused while the plugin is gone", lambda: waiting_reason(node, "plugin-down"), 90)
    assert 'required plugin "kai-isolator" not present' in reason, reason


async def _close(server: asyncio.AbstractServer) -> None:
    server.close()
    await server.wait_closed()
