"""The chart's NRI path on the real node (issue 41): the chart installed as users install it, with its default
`nodeAgent.nri.enabled=true`, on the node's containerd 2.4 (NRI on, its default validator enforcing the webhook's
required-plugins annotation) with the fake GPU's R615 driver. The agent's NRI plugin runs as the second container of the
agent's pod and registers with containerd; the agent in its pod, seeing the host's cgroups at /sys/fs/cgroup (this
hybrid host's v2 at /sys/fs/cgroup/unified, no cgroup namespace), is `driver-capped`; the seed's GPU-sharing pod is
created through the plugin, starts with the grant's values over the tenant's own, and the driver itself refuses its
raw 8 GiB allocation at the grant (nothing killed). tests/security/real_node/test_driver_cap.py proves the same with the
agent and plugin as host processes; this proves the chart carries what they need."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import yaml

from kai_isolator.services.nodeagent import grant_files
from kai_isolator.shared.contract import DEFAULT_GRANT_DIR
from support.real_node import NAMESPACE, SEED_POD, SEED_POD_NAME, LedgerWatch, Node, chart_release, ledger
from support.waiting import until

pytestmark = pytest.mark.timeout(600)
INSTALL_TIMEOUT = "300s"
GIB, MIB = 1 << 30, 1 << 20
PLUGIN = "kai-isolator"  # the chart's plugin name (templates/_helpers.tpl kri.nriPlugin)
AGENT_LABEL = "app.kubernetes.io/component=nodeagent"


@pytest.fixture(scope="module")
def release(real_node_session: Node, chart_images: None, cuda_image: str) -> Iterator[Node]:
    """The node's driver switched to R615 (before the agent starts: it decides its mode once), then the chart installed
    with its defaults; uninstalled, and the driver back to the session's default, after the module."""
    node = real_node_session
    node.real.switch_driver(615)
    try:
        with chart_release(node, "kai-isolator-helm-nri-nats", INSTALL_TIMEOUT):
            try:
                yield node
            finally:
                node.clean()  # the module's pods, before the chart that holds them goes (the next module applies the seed's)
    finally:
        node.real.switch_driver(580)  # the session's other modules run on the default driver


def agent_pod(node: Node) -> dict:
    [pod] = json.loads(node.kubectl("get", "pods", "-n", NAMESPACE, "-l", AGENT_LABEL, "-o", "json"))["items"]
    return pod  # type: ignore[no-any-return]


def container_logs(node: Node, container: str) -> str:
    return node.kubectl("logs", "-n", NAMESPACE, agent_pod(node)["metadata"]["name"], "-c", container, check=False)


def test_the_plugin_beside_the_agent_registers_with_the_nodes_containerd(release: Node) -> None:
    node = release
    statuses = {s["name"]: s for s in agent_pod(node)["status"]["containerStatuses"]}
    assert set(statuses) == {"nodeagent", "nri-plugin"}, statuses
    assert all(s["ready"] and s["restartCount"] == 0 for s in statuses.values()), statuses
    until("the chart's plugin synchronized with containerd", lambda: f"Started plugin 10-{PLUGIN}" in container_logs(node, "nri-plugin"), 60)


def test_the_agent_in_its_pod_is_driver_capped(release: Node) -> None:
    """The mode it decided at its start (its log line when it began answering the plugin): the host's v2 hierarchy is
    where it looks, and the driver answers the limits API there."""
    node = release
    lines = [json.loads(line) for line in container_logs(node, "nodeagent").splitlines() if line.startswith("{")]
    [taking_part] = [line for line in lines if line.get("msg") == "taking part in container creation"]
    assert taking_part["mode"] == "driver-capped", taking_part


def test_the_seeds_pod_gets_its_grant_through_the_charts_plugin(release: Node, cuda_image: str) -> None:
    node = release
    pod = yaml.safe_load(SEED_POD)  # its image is cuda_image's stand-in, under the seed's name
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "15360"}]  # the tenant's own
    node.apply_pod(pod)
    running = node.wait_running(SEED_POD_NAME, timeout_s=180)
    # The webhook (nodeAgent.nri.enabled) made the container require the chart's plugin.
    annotations = running["metadata"]["annotations"]
    assert json.loads(annotations["required-plugins.noderesource.dev/container.cuda"]) == [PLUGIN], annotations
    grant = grant_files.read_grant(node.node.host_path(DEFAULT_GRANT_DIR), running["metadata"]["uid"], "cuda")
    assert grant is not None, "no grant for the seed's pod"
    granted = grant.devices[0].limit_bytes // MIB
    env = dict(line.split("=", 1) for line in node.kubectl("exec", SEED_POD_NAME, "--", "env").splitlines() if "=" in line)
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == str(granted) and env["CUDA_DEVICE_MEMORY_LIMIT"] == f"{granted}m", env
    # The cap the agent set through the plugin at StartContainer: the driver refuses 8 GiB at the grant, nothing is killed.
    with LedgerWatch(ledger(node), over=granted * MIB) as watch:
        attack = node.plane.kubectl("exec", SEED_POD_NAME, "--", "rawelf", str(8 * GIB), "3000", check=False, timeout_s=60)
    assert f"alloc {8 * GIB} rc=2" in attack.stdout and attack.returncode == 0, attack
    assert watch.first_over is None and watch.peak <= granted * MIB, watch.peak
    status = node.pod(SEED_POD_NAME)["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and "running" in status["state"], status
