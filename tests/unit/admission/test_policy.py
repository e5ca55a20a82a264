"""Tenant-escape policy: each finding, the three modes, and the corrections that keep the
injection intact whatever the tenant wrote."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jsonpatch
import pytest

from kai_isolator.shared.contract import GRANT_VOLUME, STATE_VOLUME, VGPU_VOLUME
from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.webhook import Webhook

FRACTION = {"gpu-fraction": "0.5"}


def with_target(kit: SimpleNamespace, **fields: Any) -> dict[str, Any]:
    pod = kit.make_pod(FRACTION, ["main", "sidecar"])
    pod["spec"]["containers"][0].update(fields)
    return pod


def escape_pods(kit: SimpleNamespace) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (pod, a phrase its finding contains)."""
    own_preload = with_target(kit, volumeMounts=[{"name": "cm", "mountPath": "/etc/ld.so.preload", "subPath": "x"}])
    own_preload["spec"]["volumes"] = [{"name": "cm", "configMap": {"name": "empty"}}]
    sidecar_rw = kit.make_pod(FRACTION, ["main", "sidecar"])
    sidecar_rw["spec"]["containers"][1]["volumeMounts"] = [{"name": VGPU_VOLUME, "mountPath": "/lib-rw"}]
    fake_volume = kit.make_pod(FRACTION, volumes=[{"name": VGPU_VOLUME, "emptyDir": {}}])
    host_path = kit.make_pod(FRACTION, volumes=[{"name": "node", "hostPath": {"path": "/usr/local"}}])
    grants_path = kit.make_pod(FRACTION, volumes=[{"name": "node", "hostPath": {"path": "/var/lib/kai-isolator/grants/"}}])
    unconfined_container = kit.make_pod(FRACTION, ["main", "sidecar"])
    unconfined_container["spec"]["containers"][0]["securityContext"] = {"seccompProfile": {"type": "Unconfined"}}
    sidecar_grant = kit.make_pod(FRACTION, ["main", "sidecar"])
    sidecar_grant["spec"]["containers"][1]["volumeMounts"] = [{"name": GRANT_VOLUME, "mountPath": "/grants", "readOnly": True}]
    sidecar_gpu = kit.make_pod(FRACTION, ["main", "sidecar"])
    sidecar_gpu["spec"]["containers"][1]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    init_gpu = kit.make_pod(FRACTION, ["main"], inits=["setup"])
    init_gpu["spec"]["initContainers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}]
    sidecar_env_from = kit.make_pod(FRACTION, ["main", "sidecar"])
    sidecar_env_from["spec"]["containers"][1]["envFrom"] = [{"configMapRef": {"name": "evil"}}]
    sidecar_privileged = kit.make_pod(FRACTION, ["main", "sidecar"])
    sidecar_privileged["spec"]["containers"][1]["securityContext"] = {"privileged": True}
    sidecar_ptrace = kit.make_pod(FRACTION, ["main", "sidecar"])
    sidecar_ptrace["spec"]["containers"][1]["securityContext"] = {"capabilities": {"add": ["SYS_PTRACE"]}}
    return {
        "sidecar asks for the GPU": (sidecar_gpu, "container sidecar sets NVIDIA_VISIBLE_DEVICES: only the GPU-share target (main)"),
        "init container asks for the GPU": (init_gpu, "container setup sets NVIDIA_VISIBLE_DEVICES"),
        "sidecar env from a configmap": (sidecar_env_from, "container sidecar takes env from envFrom"),
        "privileged sidecar": (sidecar_privileged, "container sidecar is privileged and would see every GPU"),
        "sidecar ptrace": (sidecar_ptrace, "container sidecar adds capability SYS_PTRACE"),
        "own preload": (own_preload, "mounts its own /etc/ld.so.preload"),
        "dotted preload": (with_target(kit, volumeMounts=[{"name": "x", "mountPath": "/etc/./ld.so.preload"}]), "its own /etc/ld.so.preload"),
        "over library": (with_target(kit, volumeMounts=[{"name": "x", "mountPath": "/usr/local/vgpu/libvgpu.so"}]), "over the library directory"),
        "disable control": (with_target(kit, env=[{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]), "sets CUDA_DISABLE_CONTROL"),
        "ld preload": (with_target(kit, env=[{"name": "LD_PRELOAD", "value": "/x.so"}]), "sets LD_PRELOAD"),
        "hand-set cache": (with_target(kit, env=[{"name": "CUDA_DEVICE_MEMORY_SHARED_CACHE", "value": "/tmp/c"}]), "sets CUDA_DEVICE_MEMORY_SHARED_CACHE itself"),
        "forged pod uid": (with_target(kit, env=[{"name": "POD_UID", "value": "someone-else"}]), "sets POD_UID itself"),
        "privileged": (with_target(kit, securityContext={"privileged": True}), "is privileged"),
        "env from a configmap": (with_target(kit, envFrom=[{"configMapRef": {"name": "evil"}}]), "takes env from envFrom"),
        "sys admin": (with_target(kit, securityContext={"capabilities": {"add": ["CAP_SYS_ADMIN"]}}), "adds capability SYS_ADMIN"),
        "sidecar writes library": (sidecar_rw, f"sidecar mounts {VGPU_VOLUME} writable"),
        "pod-defined volume": (fake_volume, f"volume {VGPU_VOLUME} is defined by the pod"),
        "hostPath into the node dir": (host_path, "exposes the node path /usr/local"),
        "hostPath into the grants": (grants_path, "exposes the node path /var/lib/kai-isolator/grants"),
        "per-device limit": (with_target(kit, env=[{"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "15g"}]), "sets CUDA_DEVICE_MEMORY_LIMIT_0, which would move"),
        "visible devices": (with_target(kit, env=[{"name": "CUDA_VISIBLE_DEVICES", "value": "1"}]), "sets CUDA_VISIBLE_DEVICES, which would move"),
        "over the grant": (with_target(kit, volumeMounts=[{"name": "x", "mountPath": "/etc/kai-isolator/grant.json"}]), "over its grant directory"),
        "sidecar reads a grant": (sidecar_grant, f"sidecar mounts {GRANT_VOLUME} at /grants; only the target's own"),
        "no seccomp": (kit.make_pod(FRACTION, seccomp=None), "container main has no seccomp profile"),
        "unconfined pod": (kit.make_pod(FRACTION, seccomp="Unconfined"), "runs with seccomp profile Unconfined, which lets the tenant create a user namespace"),
        "unconfined container": (unconfined_container, "container main runs with seccomp profile Unconfined"),
    }


CASES = ["sidecar asks for the GPU", "init container asks for the GPU", "sidecar env from a configmap", "privileged sidecar",
         "sidecar ptrace", "own preload", "dotted preload", "over library", "disable control", "ld preload", "hand-set cache",
         "forged pod uid", "privileged", "env from a configmap", "sys admin", "sidecar writes library", "pod-defined volume", "hostPath into the node dir",
         "hostPath into the grants", "per-device limit", "visible devices", "over the grant", "sidecar reads a grant", "no seccomp",
         "unconfined pod", "unconfined container"]


@pytest.mark.parametrize("case", CASES)
def test_enforce_denies_naming_the_finding(kit: SimpleNamespace, case: str) -> None:
    pod, phrase = escape_pods(kit)[case]
    answer = Webhook(InjectionConfig(), "enforce").handle(kit.review_of(pod))
    response = kit.response_of(answer)
    assert response["allowed"] is False and response["status"]["code"] == 403
    assert phrase in response["status"]["message"]
    assert answer.record.decision == "denied" and any(phrase in f for f in answer.record.findings)


@pytest.mark.parametrize("case", CASES)
def test_warn_allows_with_the_finding_as_a_warning(kit: SimpleNamespace, case: str) -> None:
    pod, phrase = escape_pods(kit)[case]
    answer = Webhook(InjectionConfig(), "warn").handle(kit.review_of(pod))
    response = kit.response_of(answer)
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    assert any(phrase in w for w in response["warnings"])
    assert answer.record.decision == "warned"


@pytest.mark.parametrize("case", CASES)
def test_off_ignores_findings_but_still_injects(kit: SimpleNamespace, case: str) -> None:
    pod, _ = escape_pods(kit)[case]
    answer = Webhook(InjectionConfig(), "off").handle(kit.review_of(pod))
    response = kit.response_of(answer)
    assert response["allowed"] is True and "warnings" not in response and response["patchType"] == "JSONPatch"


def test_clean_gpu_pod_has_no_findings_in_enforce(kit: SimpleNamespace) -> None:
    answer = Webhook(InjectionConfig(), "enforce").handle(kit.review_of(kit.make_pod(FRACTION, ["main", "sidecar"])))
    assert kit.response_of(answer)["allowed"] is True and answer.record.decision == "injected"


def test_escape_env_in_a_sidecar_is_not_a_finding(kit: SimpleNamespace) -> None:
    pod = kit.make_pod(FRACTION, ["main", "sidecar"])
    pod["spec"]["containers"][1]["env"] = [{"name": "LD_PRELOAD", "value": "/x.so"}]
    assert kit.response_of(Webhook(InjectionConfig(), "enforce").handle(kit.review_of(pod)))["allowed"] is True


@pytest.mark.parametrize("value", ["void", "none", "", "NONE"])
def test_a_sidecar_that_asks_for_no_gpu_is_no_finding(kit: SimpleNamespace, value: str) -> None:
    pod = kit.make_pod(FRACTION, ["main", "sidecar"])
    pod["spec"]["containers"][1]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": value}]
    assert kit.response_of(Webhook(InjectionConfig(), "enforce").handle(kit.review_of(pod)))["allowed"] is True


def patched(kit: SimpleNamespace, pod: dict[str, Any]) -> dict[str, Any]:
    answer = Webhook(InjectionConfig(), "off").handle(kit.review_of(pod))
    return jsonpatch.apply_patch(pod, kit.patch_of(answer))


def test_tenant_preload_mount_is_replaced_by_ours(kit: SimpleNamespace) -> None:
    pod = patched(kit, escape_pods(kit)["dotted preload"][0])
    preload = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] in ("/etc/./ld.so.preload", "/etc/ld.so.preload")]
    assert preload == [{"name": VGPU_VOLUME, "mountPath": "/etc/ld.so.preload", "subPath": "ld.so.preload", "readOnly": True}]


def test_pod_defined_volume_is_replaced_by_the_node_library(kit: SimpleNamespace) -> None:
    pod = patched(kit, escape_pods(kit)["pod-defined volume"][0])
    assert pod["spec"]["volumes"][0] == {"name": VGPU_VOLUME, "hostPath": {"path": "/usr/local/vgpu", "type": "Directory"}}


def test_forged_pod_uid_is_replaced_by_the_downward_api(kit: SimpleNamespace) -> None:
    pod = patched(kit, escape_pods(kit)["forged pod uid"][0])
    uids = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "POD_UID"]
    assert uids == [{"name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}}]


def test_other_mounts_of_our_volumes_become_read_only(kit: SimpleNamespace) -> None:
    pod = kit.make_pod(FRACTION, ["main", "sidecar"])
    pod["spec"]["containers"][1]["volumeMounts"] = [{"name": VGPU_VOLUME, "mountPath": "/lib-rw"}, {"name": STATE_VOLUME, "mountPath": "/all-state"}]
    result = patched(kit, pod)
    assert all(m["readOnly"] is True for m in result["spec"]["containers"][1]["volumeMounts"])


def test_upstream_shaped_writable_library_mount_is_made_read_only(kit: SimpleNamespace) -> None:
    pod = kit.make_pod(FRACTION, volumes=[{"name": VGPU_VOLUME, "hostPath": {"path": "/usr/local/vgpu", "type": "DirectoryOrCreate"}}])
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": VGPU_VOLUME, "mountPath": "/usr/local/vgpu", "readOnly": False}]
    result = patched(kit, pod)
    assert result["spec"]["volumes"][0]["hostPath"]["type"] == "Directory"
    assert result["spec"]["containers"][0]["volumeMounts"][0] == {"name": VGPU_VOLUME, "mountPath": "/usr/local/vgpu", "readOnly": True}


def enforce(kit: SimpleNamespace, pod: dict[str, Any]) -> dict[str, Any]:
    return kit.response_of(Webhook(InjectionConfig(), "enforce").handle(kit.review_of(pod)))


@pytest.mark.parametrize(("pod_level", "container_level"), [
    ("RuntimeDefault", None), ("Localhost", None), (None, "RuntimeDefault"), (None, "Localhost"), ("Unconfined", "RuntimeDefault"),
])
def test_a_confining_seccomp_profile_is_admitted_the_containers_own_winning(kit: SimpleNamespace, pod_level: str | None, container_level: str | None) -> None:
    pod = kit.make_pod(FRACTION, seccomp=pod_level)
    if container_level:
        pod["spec"]["containers"][0]["securityContext"] = {"seccompProfile": {"type": container_level, **({"localhostProfile": "p.json"} if container_level == "Localhost" else {})}}
    if pod_level == "Localhost":
        pod["spec"]["securityContext"]["seccompProfile"]["localhostProfile"] = "p.json"
    assert enforce(kit, pod)["allowed"] is True


def test_the_seccomp_rule_is_about_the_target_only(kit: SimpleNamespace) -> None:
    pod = kit.make_pod(FRACTION, ["main", "sidecar"])
    pod["spec"]["containers"][1]["securityContext"] = {"seccompProfile": {"type": "Unconfined"}}
    assert enforce(kit, pod)["allowed"] is True
    init_target = kit.make_pod({**FRACTION, "gpu-fraction-container-name": "setup"}, ["main"], inits=["setup"])
    init_target["spec"]["initContainers"][0]["securityContext"] = {"seccompProfile": {"type": "Unconfined"}}
    response = enforce(kit, init_target)
    assert response["allowed"] is False and "container setup runs with seccomp profile Unconfined" in response["status"]["message"]


def test_the_denial_says_why_seccomp_matters(kit: SimpleNamespace) -> None:
    message = enforce(kit, kit.make_pod(FRACTION, seccomp=None))["status"]["message"]
    assert "user namespace" in message and "remount /etc/ld.so.preload" in message and "RuntimeDefault or Localhost" in message


def test_unreadable_seccomp_fields_are_a_finding_not_a_crash(kit: SimpleNamespace) -> None:
    pod = kit.make_pod(FRACTION, seccomp=None)
    pod["spec"]["securityContext"] = {"seccompProfile": {"type": ["RuntimeDefault"]}}
    pod["spec"]["containers"][0]["securityContext"] = {"seccompProfile": "RuntimeDefault"}
    response = enforce(kit, pod)
    assert response["allowed"] is False and response["status"]["code"] == 403


def test_the_webhooks_own_cache_path_is_no_finding_and_other_cuda_env_is_left_alone(kit: SimpleNamespace) -> None:
    pod = with_target(kit, env=[{"name": "CUDA_DEVICE_MEMORY_SHARED_CACHE", "value": "/run/kai-isolator/usage.cache"},
                                {"name": "CUDA_DEVICE_MEMORY_LIMIT_X", "value": "1"}, {"name": "CUDA_CACHE_PATH", "value": "/tmp"}])
    answer = Webhook(InjectionConfig(), "enforce").handle(kit.review_of(pod))
    assert kit.response_of(answer)["allowed"] is True and answer.record.findings == ()
    pod = with_target(kit, env=[{"name": "CUDA_DEVICE_MEMORY_LIMIT_12", "value": "1"}])
    assert "sets CUDA_DEVICE_MEMORY_LIMIT_12" in enforce(kit, pod)["status"]["message"]


def test_grant_env_on_a_sidecar_is_not_a_finding(kit: SimpleNamespace) -> None:
    pod = kit.make_pod(FRACTION, ["main", "sidecar"])
    pod["spec"]["containers"][1]["env"] = [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]
    assert enforce(kit, pod)["allowed"] is True


def test_other_mounts_of_the_grant_become_read_only(kit: SimpleNamespace) -> None:
    pod = kit.make_pod(FRACTION, ["main", "sidecar"])
    pod["spec"]["containers"][1]["volumeMounts"] = [{"name": GRANT_VOLUME, "mountPath": "/grants"}]
    result = patched(kit, pod)
    assert result["spec"]["containers"][1]["volumeMounts"] == [{"name": GRANT_VOLUME, "mountPath": "/grants", "readOnly": True}]
