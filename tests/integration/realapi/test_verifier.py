"""The verifier's writes to Kubernetes, as its ServiceAccount: the Event `kubectl describe pod` shows, the pod condition, the node view."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from kai_isolator.services.devcluster.kai import kai_admit
from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.services.verifier.kube import PodNotifier
from kai_isolator.shared.events import HealthVerdict, PodRef, Reason
from kai_isolator.shared.operator_view import ISOLATED_CONDITION, NODE_VIEW_ANNOTATION, NodeAgentView
from support.control_plane import Cluster, GpuNode, NO_WEBHOOK
from support.pods import gpu_pod, make_namespace
from support.webhook import NAMESPACE



async def test_verdicts_reach_the_pod_and_the_node_under_the_verifiers_rbac(control_plane: ControlPlane, gpu_node: GpuNode,
                                                                            deployed: list[dict]) -> None:
    ns = make_namespace(control_plane, "verified", labels=NO_WEBHOOK)
    cluster = Cluster(control_plane, gpu_node, ns)
    pod = cluster.create(kai_admit(gpu_pod("webhook-was-down")))
    cluster.start("webhook-was-down")
    verdict = HealthVerdict(pod=PodRef(namespace=ns, name="webhook-was-down", uid=pod["metadata"]["uid"]), node_name=gpu_node.name,
                            container="main", verdict="missing", reasons=[Reason(code="not-injected", message="no libvgpu mount")],
                            observation="a1b2c3d4")
    notifier = await PodNotifier.connect(control_plane.service_account_kubeconfig(NAMESPACE, "kai-resource-isolator-verifier"))
    try:
        assert await notifier.post_event(verdict)
        assert await notifier.post_event(verdict)  # a retried post is the same Event (409), not a second one
        assert await notifier.set_condition(verdict)
        view = NodeAgentView(node=gpu_node.name, last_seen=datetime.now(timezone.utc), ready=True, active_version="0123456789ab")
        assert await notifier.annotate_node(view)
    finally:
        await notifier.close()

    described = control_plane.kubectl("describe", "pod", "webhook-was-down", "-n", ns).stdout
    assert "IsolationMissing" in described and "container main: missing (not-injected: no libvgpu mount)" in described, described
    events = json.loads(control_plane.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
    assert [e["reason"] for e in events if e["involvedObject"]["name"] == "webhook-was-down"].count("IsolationMissing") == 1
    conditions = {c["type"]: c for c in cluster.get("webhook-was-down")["status"]["conditions"]}
    assert conditions[ISOLATED_CONDITION]["status"] == "False" and conditions[ISOLATED_CONDITION]["reason"] == "not-injected"
    assert conditions["Ready"]["status"] == "True"  # the kubelet's conditions are kept
    node = control_plane.request("GET", f"/api/v1/nodes/{gpu_node.name}")
    assert json.loads(node["metadata"]["annotations"][NODE_VIEW_ANNOTATION])["active_version"] == "0123456789ab"
