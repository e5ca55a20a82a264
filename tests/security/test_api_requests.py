"""Attacks on what the grant is computed from, through the real API server as a tenant with the `edit` role's rights in
its namespace: the pod's GPU-request annotations (our webhook refuses any change once the pod exists), its GPU-group
labels (fixed once it is bound) and KAI's ConfigMap (the tenant may edit it, so the node agent grants no more than the
fixed annotation allows, on no more devices than the pod asked for, and only on the GPUs KAI's reservation pods hold
for the pod's groups). Judged by the grant the node agent writes under its own ServiceAccount."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config

from kai_isolator.services.devcluster.kai import CONFIGMAP_ANNOTATION, fake_gpu_uuid, kai_admit
from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.services.nodeagent.grant_files import read_grant
from kai_isolator.services.nodeagent.grants import GrantKeeper
from kai_isolator.shared.contract import GPU_GROUP_LABEL, gpu_groups
from kai_isolator.shared.events import GrantDecision
from kai_isolator.shared.grant import GrantSource
from support.control_plane import Cluster, GpuNode
from support.pods import gpu_pod, make_namespace
from support.webhook import NAMESPACE, RunningWebhook

MIB = 1 << 20
REFUSED = "the GPU-sharing annotations of a pod cannot change once it exists"


def tenant_kubeconfig(plane: ControlPlane, namespace: str) -> Path:
    """A ServiceAccount with what the built-in `edit` role gives a team on pods and ConfigMaps in its namespace (spelt
    out: `edit` is filled in by kube-controller-manager's aggregation controller, which this plane does not run)."""
    plane.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                  {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant"}})
    verbs = ["get", "list", "watch", "create", "update", "patch", "delete"]
    plane.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "tenant-edit"},
        "rules": [{"apiGroups": [""], "resources": ["pods", "configmaps"], "verbs": verbs}]})
    plane.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "tenant-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant-edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": namespace}]})
    return plane.service_account_kubeconfig(namespace, "tenant")


def configmap_name(pod: dict[str, Any]) -> str:
    return f"{pod['metadata']['annotations'][CONFIGMAP_ANNOTATION]}-0"


async def decided(plane: ControlPlane, node: GpuNode, root: Path, uid: str) -> GrantDecision:
    """The node agent's decision for the pod, computed as it runs: its own ServiceAccount, the pod and ConfigMap as the
    API server now holds them."""
    decisions: list[GrantDecision] = []

    async def publish(decision: GrantDecision) -> None:
        decisions.append(decision)

    kubeconfig = plane.service_account_kubeconfig(NAMESPACE, "kai-resource-isolator-nodeagent")
    async with await config.new_client_from_config(config_file=str(kubeconfig)) as api:
        task = asyncio.create_task(GrantKeeper(api, node.name, root, publish, retry_s=0.05, stale_grace_s=0).run())
        try:
            deadline = time.monotonic() + 15
            while not (mine := [d for d in decisions if d.pod.uid == uid]):
                assert time.monotonic() < deadline, f"no decision for {uid}: {decisions}"
                await asyncio.sleep(0.05)
            return mine[0]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
def tenant(control_plane: ControlPlane, gpu_node: GpuNode, webhook: RunningWebhook) -> tuple[Cluster, Path]:
    namespace = make_namespace(control_plane, "tenant")  # our webhook judges this namespace's pods
    return Cluster(control_plane, gpu_node, namespace), tenant_kubeconfig(control_plane, namespace)


@pytest.mark.parametrize("change", [["gpu-memory=15000"], ["gpu-fraction-num-devices=2"], ["gpu-memory-"], ["gpu-fraction=1"]])
def test_the_tenant_cannot_change_the_gpu_request_of_its_pod(control_plane: ControlPlane, tenant: tuple[Cluster, Path],
                                                             change: list[str]) -> None:
    cluster, kubeconfig = tenant
    pod = cluster.create(kai_admit(gpu_pod("train", injected=True)))
    cluster.start("train")  # booked and bound by KAI: 4147m on the T4
    done = control_plane.kubectl("annotate", "--overwrite", "-n", cluster.namespace, "pod", "train", *change, kubeconfig=kubeconfig, check=False)
    assert done.returncode != 0 and REFUSED in done.stderr, done.stderr + done.stdout
    assert cluster.get("train")["metadata"]["annotations"] == pod["metadata"]["annotations"]
    # What the tenant may change still changes: the webhook refuses only the GPU request.
    control_plane.kubectl("label", "-n", cluster.namespace, "pod", "train", "team=vision", kubeconfig=kubeconfig)
    control_plane.kubectl("annotate", "-n", cluster.namespace, "pod", "train", "note=mine", kubeconfig=kubeconfig)


def test_a_pod_created_without_a_gpu_request_cannot_be_given_one(control_plane: ControlPlane, tenant: tuple[Cluster, Path]) -> None:
    cluster, kubeconfig = tenant
    cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
                    "spec": {"schedulerName": "kai-scheduler", "containers": [{"name": "main", "image": "busybox"}]}})
    done = control_plane.kubectl("annotate", "-n", cluster.namespace, "pod", "plain", "gpu-memory=4096", kubeconfig=kubeconfig, check=False)
    assert done.returncode != 0 and REFUSED in done.stderr, done.stderr + done.stdout


def test_the_tenant_cannot_move_its_bound_pod_to_another_gpu_group(control_plane: ControlPlane, tenant: tuple[Cluster, Path]) -> None:
    cluster, kubeconfig = tenant
    cluster.create(kai_admit(gpu_pod("placed", injected=True)))
    cluster.start("placed")  # KAI's binder put it in GPU 0's group, then bound it
    group = cluster.get("placed")["metadata"]["labels"][GPU_GROUP_LABEL]
    for change in ([f"{GPU_GROUP_LABEL}=someone-elses", "--overwrite"], [f"{GPU_GROUP_LABEL}-"], [f"{GPU_GROUP_LABEL}/extra=extra"]):
        done = control_plane.kubectl("label", "-n", cluster.namespace, "pod", "placed", *change, kubeconfig=kubeconfig, check=False)
        assert done.returncode != 0 and "GPU-group labels of a bound pod cannot change" in done.stderr, done.stderr + done.stdout
    assert gpu_groups(cluster.get("placed")["metadata"]["labels"]) == {group}


@pytest.mark.parametrize("edit", ["raise-limit", "both-gpus", "other-gpu"])
async def test_an_edited_configmap_grants_no_more_than_was_booked(control_plane: ControlPlane, gpu_node: GpuNode,
                                                                 tenant: tuple[Cluster, Path], tmp_path: Path, edit: str) -> None:
    cluster, kubeconfig = tenant
    pod = cluster.create(kai_admit(gpu_pod(f"edit-{edit}", injected=True)))
    cluster.start(pod["metadata"]["name"])
    # other-gpu: one device, as asked, but not the one KAI reserved for the pod (a whole-GPU tenant's, say).
    data = {"raise-limit": {"CUDA_DEVICE_MEMORY_LIMIT": "15000m"}, "both-gpus": {"NVIDIA_VISIBLE_DEVICES": f"{fake_gpu_uuid(0)},{fake_gpu_uuid(1)}"},
            "other-gpu": {"NVIDIA_VISIBLE_DEVICES": fake_gpu_uuid(1)}}[edit]
    # The tenant may edit its namespace's ConfigMaps, KAI's among them: the API server lets this through.
    control_plane.kubectl("patch", "-n", cluster.namespace, "configmap", configmap_name(pod), "--type=merge", "-p", json.dumps({"data": data}),
                          kubeconfig=kubeconfig)
    decision = await decided(control_plane, gpu_node, tmp_path / "grants", pod["metadata"]["uid"])
    grant = read_grant(tmp_path / "grants", pod["metadata"]["uid"], "main")
    if edit == "raise-limit":  # held to the annotation's 4096 of 15360 MiB, as KAI booked it
        assert grant is not None and grant.source is GrantSource.ANNOTATION, decision
        assert [(d.uuid, d.limit_bytes) for d in grant.devices] == [(fake_gpu_uuid(0), 4147 * MIB)]
    elif edit == "both-gpus":  # no grant: the enforcer holds the container to 0 (tests/security/test_shipped_defaults.py)
        assert grant is None and decision.outcome == "withheld", decision
        assert "devices-invalid" in [r.code for r in decision.reasons] and "gpu-fraction-num-devices" in decision.reasons[0].message
    else:
        assert grant is None and decision.outcome == "withheld", decision
        assert [r.code for r in decision.reasons] == ["devices-not-reserved"] and fake_gpu_uuid(0) in decision.reasons[0].message, decision
