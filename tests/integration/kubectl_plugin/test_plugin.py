"""`kubectl isolator` against the API server the tests use: status, describe, nodes, their exit codes and JSON,
an empty cluster, bad kubeconfigs, an unreachable API, a forbidden namespace and a tenant's tampered annotations."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import jsonschema
import pytest

from kai_isolator.services.kubectl_plugin.views import NodeList, PodStory, StatusList
from kai_isolator.services.verifier.view import NodeViews
from kai_isolator.shared.events import Breach, BreachedProcess, DeviceUsage, HealthVerdict, NodeStatus, PodRef, Reason, UsageReport
from support.kubectl_plugin import BIN, Cluster, run

MIB = 1 << 20


def verdict(pod: dict, kind: str, *codes: str, observation: str = "o1") -> HealthVerdict:  # type: ignore[type-arg]
    ref = PodRef(namespace=pod["metadata"]["namespace"], name=pod["metadata"]["name"], uid=pod["metadata"]["uid"])
    breach = None
    if kind == "breached":
        breach = Breach(breach_id="b1", device_uuid="GPU-1", grant_bytes=4147 * MIB, tolerance_bytes=512 * MIB, measured_bytes=6000 * MIB,
                        processes=[BreachedProcess(pid=4242, used_bytes=6000 * MIB, killed=True)], action="killed")
    return HealthVerdict(pod=ref, node_name="gpu-1", container="main", verdict=kind, observation=observation,  # type: ignore[arg-type]
                         reasons=[Reason(code=c, message=f"{c} seen") for c in codes], breach=breach)


async def tell(cluster: Cluster, v: HealthVerdict) -> None:
    """What the verifier does with a verdict: an Event and the pod condition."""
    assert await cluster.notifier.post_event(v)
    assert await cluster.notifier.set_condition(v)


async def node_view(cluster: Cluster, node: str, pods: list[tuple[dict, int, int]], *, self_check: str = "passed",  # type: ignore[type-arg]
                    mode: str = "library-and-enforcer") -> None:
    """The verifier's node view from an agent's status and usage reports, written through the API."""
    views = NodeViews(cluster.notifier)
    views.on_status(NodeStatus(node_name=node, sequence=1, ready=True, active_version="a1b2c3d4e5f6", installed_versions=["a1b2c3d4e5f6", "0f9e8d7c6b5a"],
                               self_check=self_check, enforcer="enforcing", gpu_count=1, mode=mode))  # type: ignore[arg-type]
    for pod, grant, used in pods:
        ref = PodRef(namespace=pod["metadata"]["namespace"], name=pod["metadata"]["name"], uid=pod["metadata"]["uid"])
        views.on_usage(UsageReport(pod=ref, node_name=node, container="main", source="driver",
                                   devices=[DeviceUsage(index=0, uuid="GPU-1", limit_bytes=grant, used_bytes=used)]))
    assert await views.flush() == 1


async def test_an_empty_cluster_lists_nothing_and_exits_zero(cluster: Cluster) -> None:
    table = await cluster.plugin("status", "-A")
    assert table.code == 0 and table.out == "" and "No GPU-sharing pods found in any namespace" in table.err
    listed = await cluster.plugin("status", "-o", "json")
    assert listed.code == 0 and listed.json() == {"apiVersion": "kai-resource-isolator.io/v1", "kind": "IsolationStatusList", "items": [], "warnings": []}
    nodes = await cluster.plugin("nodes")
    assert nodes.code == 0 and "No GPU nodes found" in nodes.err


async def test_status_shows_every_container_problems_first_and_fails_on_missing_or_breached(cluster: Cluster) -> None:
    await cluster.node("gpu-1")
    good = await cluster.pod("good")
    bad = await cluster.pod("bad", injected=False)
    hot = await cluster.pod("hot")
    await cluster.pod("waiting", running=False, node=None)
    await cluster.pod("plain", annotations={})  # not GPU-sharing: never listed
    await tell(cluster, verdict(good, "verified"))
    await tell(cluster, verdict(bad, "missing", "not-injected"))
    await tell(cluster, verdict(hot, "breached", "over-grant", "killed"))
    await node_view(cluster, "gpu-1", [(good, 4147 * MIB, 1024 * MIB), (hot, 4147 * MIB, 6000 * MIB)])

    result = await cluster.plugin("status", "-A")
    assert result.code == 3, result.err
    lines = result.out.splitlines()
    assert lines[0].split() == ["NAMESPACE", "POD", "CONTAINER", "NODE", "GRANT", "USED", "VERDICT", "REASON", "AGE"]
    rows = [line.split() for line in lines[1:]]
    assert [r[1] for r in rows] == ["hot", "bad", "waiting", "good"]  # breached, missing, pending, verified
    assert rows[0][4:8] == ["4147Mi", "6000Mi", "breached", "over-grant"]
    assert rows[1][4:8] == ["4147Mi", "<none>", "missing", "not-injected"], result.out  # grant claimed by the pod's env; no usage reported
    assert rows[2][6:8] == ["pending", "not-running"] and rows[3][4:8] == ["4147Mi", "1024Mi", "verified", "verified"]
    assert "\x1b[" not in result.out  # not a terminal: no colour

    # Namespaced, the NAMESPACE column goes, as with kubectl.
    namespaced = await cluster.plugin("status", "-n", "default", "-o", "wide")
    assert namespaced.out.splitlines()[0].split()[:2] == ["POD", "CONTAINER"] and "GRANT-FROM" in namespaced.out
    assert "node" in namespaced.out and "pod-env" in namespaced.out

    # A namespace with only verified containers passes a CI gate.
    await cluster.namespace("calm")
    fine = await cluster.pod("fine", namespace="calm")
    await tell(cluster, verdict(fine, "verified"))
    assert (await cluster.plugin("status", "-n", "calm")).code == 0


async def test_json_output_has_the_published_schema(cluster: Cluster) -> None:
    pod = await cluster.pod("p")
    await tell(cluster, verdict(pod, "degraded", "limit-from-env"))
    result = await cluster.plugin("status", "-o", "json")
    assert result.code == 0  # degraded is reported, not a failure
    document = result.json()
    jsonschema.validate(document, StatusList.model_json_schema())
    [item] = document["items"]
    assert item["verdict"] == "degraded" and item["reason"] == "limit-from-env" and item["verdict_from"] == "condition"
    assert item["message"] == "degraded: container main: limit-from-env: limit-from-env seen"
    assert datetime.fromisoformat(item["verdict_at"]) > datetime.now(timezone.utc) - timedelta(minutes=1)
    as_yaml = await cluster.plugin("status", "-o", "yaml")
    import yaml
    assert yaml.safe_load(as_yaml.out) == document


async def test_a_tenants_tampered_annotations_change_no_verdict_and_no_grant(cluster: Cluster) -> None:
    await cluster.node("gpu-1")
    pod = await cluster.pod("sneaky")
    await tell(cluster, verdict(pod, "missing", "no-preload"))
    await node_view(cluster, "gpu-1", [(pod, 4147 * MIB, 100 * MIB)])
    # The tenant edits what it may edit: its pod's annotations (a bigger request, a forged verdict, the GPU-sharing marker gone).
    await cluster.core.patch_namespaced_pod("sneaky", "default", {"metadata": {"annotations": {
        "gpu-memory": None, "gpu-fraction": "1.0", "kai-resource-isolator.io/isolation-missing": None,
        "kai-resource-isolator.io/verdict": "verified"}}})
    await cluster.core.patch_namespaced_pod("sneaky", "default", {"metadata": {"annotations": {"gpu-fraction": None}}})
    result = await cluster.plugin("status", "-o", "json")
    [item] = result.json()["items"]  # still listed: it carries our condition
    assert result.code == 3 and item["verdict"] == "missing" and item["reason"] == "no-preload"
    assert item["grant_bytes"] == 4147 * MIB and item["grant_from"] == "node" and item["requested"] == ""
    story = await cluster.plugin("describe", "sneaky", "-o", "json")
    assert story.json()["annotations"] == {"kai-resource-isolator.io/verdict": "verified"}  # shown for what it is, trusted for nothing
    assert story.json()["containers"][0]["verdict"] == "missing"


async def test_describe_tells_the_pods_story_in_order(cluster: Cluster) -> None:
    pod = await cluster.pod("story")
    await tell(cluster, verdict(pod, "verified", observation="o1"))
    await tell(cluster, verdict(pod, "breached", "over-grant", "killed", observation="o2"))
    result = await cluster.plugin("describe", "story")
    assert result.code == 3, result.err
    assert "Verdict:     breached (over-grant)" in result.out and "Grant:       4147Mi (from pod-env)" in result.out
    whats = [line.split()[2] for line in result.out.split("Story:\n", 1)[1].splitlines()[1:]]
    assert whats[:3] == ["Created", "Injected", "Bound"]
    assert whats.index("IsolationVerified") < whats.index("IsolationBreached")
    document = (await cluster.plugin("describe", "story", "-o", "json")).json()
    jsonschema.validate(document, PodStory.model_json_schema())
    times = [datetime.fromisoformat(e["time"]) for e in document["story"]]
    assert times == sorted(times)

    opted_out = await cluster.pod("opted", injected=False, annotations={"gpu-memory": "4096", "kai-resource-isolator.io/inject": "false"})
    await tell(cluster, verdict(opted_out, "missing", "not-injected"))
    told = (await cluster.plugin("describe", "opted", "-o", "json")).json()
    [not_injected] = [e for e in told["story"] if e["what"] == "NotInjected"]
    assert "kai-resource-isolator.io/inject=false" in not_injected["detail"] and not_injected["kind"] == "Warning"


async def test_nodes_show_versions_agent_and_over_commitment(cluster: Cluster) -> None:
    await cluster.node("gpu-1", memory_mib=8192)
    await cluster.node("gpu-2")
    first, second = await cluster.pod("a"), await cluster.pod("b")
    await node_view(cluster, "gpu-1", [(first, 6000 * MIB, 0), (second, 6000 * MIB, 0)], mode="driver-capped")
    result = await cluster.plugin("nodes")
    assert result.code == 0, result.err
    assert result.out.splitlines()[0].split()[5:7] == ["ENFORCER", "MODE"]
    rows = {line.split()[0]: line for line in result.out.splitlines()[1:]}
    assert rows["gpu-1"].split()[1:9] == ["ready", "a1b2c3d4e5f6", "0f9e8d7c6b5a", "passed", "enforcing", "driver-capped",
                                          rows["gpu-1"].split()[7], "2"]
    assert "12000Mi" in rows["gpu-1"] and "8192Mi (over-committed)" in rows["gpu-1"]
    assert rows["gpu-2"].split()[1] == "unseen"
    document = (await cluster.plugin("nodes", "-o", "json")).json()
    jsonschema.validate(document, NodeList.model_json_schema())

    await node_view(cluster, "gpu-1", [], self_check="failed")
    failing = await cluster.plugin("nodes", "-o", "json")
    assert failing.code == 3 and failing.json()["items"][0]["self_check"] == "failed"


async def test_bad_input_is_a_clear_error_never_a_traceback(cluster: Cluster, tmp_path: Path, tenant_kubeconfig: Path) -> None:
    missing = await cluster.plugin("describe", "no-such-pod")
    assert missing.code == 1 and missing.err.strip() == 'Error from server (NotFound): pods "no-such-pod" not found'
    no_file = await cluster.plugin("status", kubeconfig=tmp_path / "absent")
    assert no_file.code == 1 and no_file.err.startswith("error: no kubeconfig: ") and "Traceback" not in no_file.err
    closed = tmp_path / "closed-kubeconfig"
    document = json.loads(cluster.kubeconfig.read_text())
    document["clusters"][0]["cluster"]["server"] = "http://127.0.0.1:9"
    closed.write_text(json.dumps(document))
    unreachable = await cluster.plugin("status", kubeconfig=closed)
    assert unreachable.code == 1 and "cannot reach the Kubernetes API at http://127.0.0.1:9" in unreachable.err and "Traceback" not in unreachable.err
    context = await cluster.plugin("status", "--context", "nope")
    assert context.code == 1 and "nope" in context.err and "Traceback" not in context.err
    usage = await run([str(BIN / "kubectl-isolator"), "status", "-o", "toml"])
    assert usage.code == 2 and "invalid choice" in usage.err

    # A user bound to namespaces other than `locked`.
    await cluster.pod("mine")
    locked = await cluster.plugin("status", "-n", "locked", kubeconfig=tenant_kubeconfig)
    assert locked.code == 1 and "Traceback" not in locked.err
    assert locked.err.strip() == 'Error from server (Forbidden): pods is forbidden: User "system:serviceaccount:default:tenant" cannot list resource "pods" in API group "" in the namespace "locked"'
    everywhere = await cluster.plugin("status", "-A", kubeconfig=tenant_kubeconfig)
    assert everywhere.code == 1 and "at the cluster scope" in everywhere.err
    # Its own namespace works, without the Node views it may not read (said on stderr).
    own = await cluster.plugin("status", "-n", "default", "-o", "json", kubeconfig=tenant_kubeconfig)
    assert own.code == 0 and [i["pod"] for i in own.json()["items"]] == ["mine"]
    assert "Warning: grant and usage (the node views) not shown: Error from server (Forbidden)" in own.err


async def test_colour_on_a_terminal_only(cluster: Cluster) -> None:
    pod = await cluster.pod("p")
    await tell(cluster, verdict(pod, "missing", "not-injected"))
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"} | {"TERM": "xterm"}
    process = subprocess.Popen([str(BIN / "kubectl-isolator"), "status", "--kubeconfig", str(cluster.kubeconfig)], stdout=follower, stderr=follower, env=env)
    os.close(follower)
    import asyncio
    code = await asyncio.to_thread(process.wait, 60)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert code == 3 and b"\x1b[31mmissing\x1b[0m" in output
    plain = await cluster.plugin("status", env={"NO_COLOR": "1"})
    assert "\x1b[" not in plain.out


@pytest.mark.skipif(shutil.which("kubectl", path=f"{BIN}:{os.environ.get('PATH', '')}") is None, reason="kubectl not installed")
async def test_real_kubectl_finds_the_plugin_and_waits_on_the_condition(cluster: Cluster) -> None:
    kubectl = shutil.which("kubectl", path=f"{BIN}:{os.environ.get('PATH', '')}")
    assert kubectl is not None
    env = {"PATH": f"{BIN}:{os.environ.get('PATH', '')}", "KUBECONFIG": str(cluster.kubeconfig)}
    listed = await run([kubectl, "plugin", "list"], env=env)
    assert "kubectl-isolator" in listed.out
    pod = await cluster.pod("p")
    await tell(cluster, verdict(pod, "verified"))
    result = await run([kubectl, "isolator", "status", "-o", "json"], env=env)
    assert result.code == 0, result.err
    assert result.json()["items"][0]["verdict"] == "verified", result.out
    waited = await run([kubectl, "wait", "--for=condition=kai-resource-isolator.io/Isolated", "pod/p", "--timeout=20s"], env=env)
    assert waited.code == 0, waited.err
