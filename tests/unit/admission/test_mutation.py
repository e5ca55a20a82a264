"""Upstream's V4 webhook cases (main_test.go), adapted to the read-only library dir and the
per-container state directory, plus target resolution and opt-out."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from kai_isolator.shared.contract import GRANT_VOLUME, STATE_VOLUME, USAGE_CACHE_PATH, VGPU_VOLUME
from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.mutation import patch_ops
from kai_isolator.services.admission.pod import NoTargetContainer, find_target, is_gpu_sharing, read_pod
from kai_isolator.services.admission.webhook import Webhook

LIB_MOUNT = {"name": VGPU_VOLUME, "mountPath": "/usr/local/vgpu", "readOnly": True}
PRELOAD_MOUNT = {"name": VGPU_VOLUME, "mountPath": "/etc/ld.so.preload", "subPath": "ld.so.preload", "readOnly": True}
VGPU_VOL = {"name": VGPU_VOLUME, "hostPath": {"path": "/usr/local/vgpu", "type": "Directory"}}
STATE_VOL = {"name": STATE_VOLUME, "hostPath": {"path": "/var/lib/kai-isolator/containers", "type": "DirectoryOrCreate"}}
GRANT_VOL = {"name": GRANT_VOLUME, "hostPath": {"path": "/var/lib/kai-isolator/grants", "type": "DirectoryOrCreate"}}


def state_mount(container: str) -> dict[str, object]:
    return {"name": STATE_VOLUME, "mountPath": "/run/kai-isolator", "subPathExpr": f"$(POD_UID)_{container}"}


def grant_mount(container: str) -> dict[str, object]:
    return {"name": GRANT_VOLUME, "mountPath": "/etc/kai-isolator", "subPathExpr": f"$(POD_UID)_{container}", "readOnly": True}


def env_for(container: str) -> list[dict[str, object]]:
    return [
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}},
        {"name": "CONTAINER_NAME", "value": container},
        {"name": "CONTAINER_VGPU_MOUNT", "value": "/usr/local/vgpu"},
        {"name": "CUDA_DEVICE_MEMORY_SHARED_CACHE", "value": USAGE_CACHE_PATH},
    ]


FRACTION = {"gpu-fraction": "0.5"}


@pytest.mark.parametrize(("annotations", "expected"), [
    ({}, False), ({"gpu-fraction": "0.5"}, True), ({"gpu-memory": "4096"}, True),
    ({"gpu-fraction": "0.5", "gpu-memory": "4096"}, True), ({"foo": "bar"}, False),
])
def test_pod_needs_injection(annotations: dict[str, str], expected: bool) -> None:
    assert is_gpu_sharing(annotations) is expected


@pytest.mark.parametrize("annotations", [None, {}, {"foo": "bar"}])
def test_pod_without_gpu_annotations_is_allowed_without_patch(kit: SimpleNamespace, webhook: Webhook, annotations: dict[str, str] | None) -> None:
    answer = webhook.handle(kit.review_of(kit.make_pod(annotations)))
    assert kit.response_of(answer) == {"uid": "uid-1", "allowed": True}
    assert answer.record.decision == "skipped" and "not a GPU-sharing pod" in answer.record.reason


def test_single_container_gets_three_array_ops(kit: SimpleNamespace, mutate) -> None:
    ops = mutate(kit.make_pod(FRACTION))
    assert [op["path"] for op in ops] == ["/spec/volumes", "/spec/containers/0/volumeMounts", "/spec/containers/0/env"]
    assert all(op["op"] == "add" for op in ops)
    assert ops[0]["value"] == [VGPU_VOL, STATE_VOL, GRANT_VOL]
    assert ops[1]["value"] == [LIB_MOUNT, PRELOAD_MOUNT, state_mount("main"), grant_mount("main")]
    assert ops[2]["value"] == env_for("main")


def test_multi_container_only_the_named_fraction_container(kit: SimpleNamespace, mutate) -> None:
    pod = kit.make_pod({**FRACTION, "gpu-fraction-container-name": "gpu-container"}, ["sidecar-a", "gpu-container", "sidecar-b"])
    ops = mutate(pod)
    assert len(kit.ops_for(ops, "/spec/containers/1/volumeMounts")[0]["value"]) == 4
    assert len(kit.ops_for(ops, "/spec/containers/1/env")) == 1
    assert not [op for op in ops if op["path"].startswith(("/spec/containers/0", "/spec/containers/2"))]


def test_without_name_annotation_the_first_container_is_the_target(kit: SimpleNamespace, mutate) -> None:
    ops = mutate(kit.make_pod(FRACTION, ["main", "sidecar"]))
    assert len(kit.ops_for(ops, "/spec/containers/0/volumeMounts")[0]["value"]) == 4
    assert not [op for op in ops if op["path"].startswith("/spec/containers/1")]


def test_init_containers_are_not_injected_by_default(kit: SimpleNamespace, mutate) -> None:
    ops = mutate(kit.make_pod(FRACTION, ["main"], inits=["setup"]))
    assert not [op for op in ops if op["path"].startswith("/spec/initContainers")]
    assert len(kit.ops_for(ops, "/spec/containers/0/volumeMounts")[0]["value"]) == 4


def test_an_init_container_target_gets_what_a_main_container_target_gets(kit: SimpleNamespace, mutate) -> None:
    """Issue 26 changed this: an init-container target with only the library and preload took its limit
    from the environment the tenant controls. It now gets the grant, state dir and env too."""
    pod = kit.make_pod({**FRACTION, "gpu-fraction-container-name": "gpu-init"}, ["main"], inits=["gpu-init"])
    ops = mutate(pod)
    main = mutate(kit.make_pod({**FRACTION, "gpu-fraction-container-name": "gpu-init"}, ["gpu-init"]))
    assert kit.ops_for(ops, "/spec/volumes")[0]["value"] == kit.ops_for(main, "/spec/volumes")[0]["value"]
    assert kit.ops_for(ops, "/spec/initContainers/0/volumeMounts")[0]["value"] == kit.ops_for(main, "/spec/containers/0/volumeMounts")[0]["value"]
    assert kit.ops_for(ops, "/spec/initContainers/0/env")[0]["value"] == kit.ops_for(main, "/spec/containers/0/env")[0]["value"]
    assert not [op for op in ops if op["path"].startswith("/spec/containers")]
    text = orjson.dumps(ops).decode()
    assert STATE_VOLUME in text and GRANT_VOLUME in text and "POD_UID" in text


def test_init_containers_are_searched_before_containers(kit: SimpleNamespace) -> None:
    pod = kit.make_pod({"gpu-fraction-container-name": "same"}, ["same"], inits=["same"])
    target = find_target(read_pod(pod))
    assert (target.field, target.index) == ("initContainers", 0)


def test_annotation_naming_an_unknown_container_is_denied_with_the_name(kit: SimpleNamespace, webhook: Webhook) -> None:
    pod = kit.make_pod({**FRACTION, "gpu-fraction-container-name": "no-such-container"})
    with pytest.raises(NoTargetContainer, match="no-such-container"):
        find_target(read_pod(pod))
    answer = webhook.handle(kit.review_of(pod))
    response = kit.response_of(answer)
    assert response["allowed"] is False and "'no-such-container' not found" in response["status"]["message"]
    assert answer.record.decision == "denied"


def test_pod_with_no_containers_is_denied(kit: SimpleNamespace, webhook: Webhook) -> None:
    response = kit.response_of(webhook.handle(kit.review_of(kit.make_pod(FRACTION, containers=[]))))
    assert response["allowed"] is False and response["status"]["message"] == "pod has no containers"


def test_volume_already_present_only_the_missing_one_is_appended(kit: SimpleNamespace, mutate) -> None:
    ops = mutate(kit.make_pod(FRACTION, volumes=[dict(VGPU_VOL)]))
    assert not kit.ops_for(ops, "/spec/volumes")
    assert [op["value"] for op in kit.ops_for(ops, "/spec/volumes/-")] == [STATE_VOL, GRANT_VOL]
    assert len(kit.ops_for(ops, "/spec/containers/0/volumeMounts")[0]["value"]) == 4


def fully_injected(kit: SimpleNamespace) -> dict[str, object]:
    pod = kit.make_pod(FRACTION, volumes=[dict(VGPU_VOL), dict(STATE_VOL), dict(GRANT_VOL)])
    pod["spec"]["containers"][0].update(volumeMounts=[LIB_MOUNT, PRELOAD_MOUNT, state_mount("main"), grant_mount("main")], env=env_for("main"))
    return pod


def test_pod_that_has_everything_gets_no_patch(kit: SimpleNamespace, webhook: Webhook) -> None:
    answer = webhook.handle(kit.review_of(fully_injected(kit)))
    assert kit.response_of(answer) == {"uid": "uid-1", "allowed": True}
    assert answer.record.decision == "skipped" and answer.record.reason == "already injected"


def test_partially_injected_pod_gets_only_the_missing_mounts_preload_first(kit: SimpleNamespace, mutate) -> None:
    pod = fully_injected(kit)
    pod["spec"]["containers"][0]["volumeMounts"] = [LIB_MOUNT]
    ops = mutate(pod)
    assert [op["path"] for op in ops] == ["/spec/containers/0/volumeMounts/-"] * 3
    assert [op["value"] for op in ops] == [PRELOAD_MOUNT, state_mount("main"), grant_mount("main")]


def test_partially_injected_env_gets_only_missing_vars(kit: SimpleNamespace, mutate) -> None:
    pod = fully_injected(kit)
    pod["spec"]["containers"][0]["env"] = env_for("main")[:2] + [{"name": "OTHER", "value": "1"}]
    ops = mutate(pod)
    assert [(op["path"], op["value"]["name"]) for op in ops] == [
        ("/spec/containers/0/env/-", "CONTAINER_VGPU_MOUNT"), ("/spec/containers/0/env/-", "CUDA_DEVICE_MEMORY_SHARED_CACHE"),
    ]


def test_gpu_memory_annotation_injects_and_never_sets_the_limit(kit: SimpleNamespace, mutate) -> None:
    text = orjson.dumps(mutate(kit.make_pod({"gpu-memory": "4096"}))).decode()
    assert "POD_UID" in text and STATE_VOLUME in text and USAGE_CACHE_PATH in text
    assert "CUDA_DEVICE_MEMORY_LIMIT" not in text


def test_mount_values_library_read_only_and_state_per_container(kit: SimpleNamespace, mutate) -> None:
    ops = mutate(kit.make_pod(FRACTION))
    volumes, mounts, env = (op["value"] for op in ops)
    assert volumes[0]["hostPath"] == {"path": "/usr/local/vgpu", "type": "Directory"}
    assert volumes[1]["hostPath"] == {"path": "/var/lib/kai-isolator/containers", "type": "DirectoryOrCreate"}
    assert mounts[0]["readOnly"] is True and mounts[1]["readOnly"] is True and mounts[1]["subPath"] == "ld.so.preload"
    assert mounts[2]["subPathExpr"] == "$(POD_UID)_main" and "readOnly" not in mounts[2]
    assert env[0] == {"name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}}
    assert env[1] == {"name": "CONTAINER_NAME", "value": "main"}
    assert env[2] == {"name": "CONTAINER_VGPU_MOUNT", "value": "/usr/local/vgpu"}
    assert env[3] == {"name": "CUDA_DEVICE_MEMORY_SHARED_CACHE", "value": "/run/kai-isolator/usage.cache"}


def test_named_regular_container_gets_its_own_name_and_state_dir(kit: SimpleNamespace, mutate) -> None:
    ops = mutate(kit.make_pod({**FRACTION, "gpu-fraction-container-name": "gpu-workload"}, ["sidecar", "gpu-workload"]))
    assert '"value":"gpu-workload"' in orjson.dumps(ops).decode()
    assert kit.ops_for(ops, "/spec/containers/1/env") and not kit.ops_for(ops, "/spec/containers/0/env")
    assert state_mount("gpu-workload") in kit.ops_for(ops, "/spec/containers/1/volumeMounts")[0]["value"]


def test_configured_directories_are_used(kit: SimpleNamespace) -> None:
    config = InjectionConfig(container_vgpu_mount="/opt/vgpu", state_dir="/srv/state")
    pod = kit.make_pod(FRACTION)
    view = read_pod(pod)
    ops = patch_ops(view, find_target(view), config)
    assert ops[0]["value"][0]["hostPath"]["path"] == "/opt/vgpu" and ops[0]["value"][1]["hostPath"]["path"] == "/srv/state"
    assert ops[1]["value"][0]["mountPath"] == "/opt/vgpu"
    assert {"name": "CONTAINER_VGPU_MOUNT", "value": "/opt/vgpu"} in ops[2]["value"]


@pytest.mark.parametrize("value", ["false", "FALSE", "False"])
def test_opt_out_annotation_is_case_insensitive(kit: SimpleNamespace, webhook: Webhook, value: str) -> None:
    answer = webhook.handle(kit.review_of(kit.make_pod({**FRACTION, "kai-resource-isolator.io/inject": value})))
    assert kit.response_of(answer) == {"uid": "uid-1", "allowed": True}
    assert "opted out" in answer.record.reason


@pytest.mark.parametrize("value", ["true", "no", ""])
def test_other_opt_out_values_are_ignored(kit: SimpleNamespace, mutate, value: str) -> None:
    assert mutate(kit.make_pod({**FRACTION, "kai-resource-isolator.io/inject": value}))


def test_opt_out_is_ignored_with_a_warning_when_forbidden(kit: SimpleNamespace) -> None:
    webhook = Webhook(InjectionConfig(allow_pod_opt_out=False), "enforce")
    answer = webhook.handle(kit.review_of(kit.make_pod({**FRACTION, "kai-resource-isolator.io/inject": "false"})))
    response = kit.response_of(answer)
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    assert any("opt-out is disabled" in w for w in response["warnings"])


@pytest.mark.parametrize("operation", ["DELETE", "CONNECT"])
def test_only_create_is_mutated(kit: SimpleNamespace, webhook: Webhook, operation: str) -> None:
    answer = webhook.handle(kit.review_of(kit.make_pod(FRACTION), operation=operation))
    assert kit.response_of(answer) == {"uid": "uid-1", "allowed": True}
    assert operation in answer.record.reason


def test_an_update_that_keeps_the_gpu_request_is_allowed_unpatched_and_unpublished(kit: SimpleNamespace, webhook: Webhook) -> None:
    old = kit.make_pod(FRACTION)
    new = {**old, "metadata": {**old["metadata"], "labels": {"runai-gpu-group": "g-1"}}}
    answer = webhook.handle(kit.review_of(new, operation="UPDATE", old=old))
    assert kit.response_of(answer) == {"uid": "uid-1", "allowed": True}
    assert answer.record.decision == "skipped" and not answer.record.published


@pytest.mark.parametrize(("before", "after"), [
    ({"runai-gpu-group": "g-1"}, {"runai-gpu-group": "g-2"}),  # moved to the group of another GPU
    ({"runai-gpu-group": "g-1"}, {}),
    ({}, {"runai-gpu-group": "g-2"}),
    ({"runai-gpu-group/g-1": "g-1"}, {"runai-gpu-group/g-1": "g-1", "runai-gpu-group/g-2": "g-2"}),
])
def test_the_gpu_groups_of_a_bound_pod_are_fixed(kit: SimpleNamespace, before: dict[str, str], after: dict[str, str]) -> None:
    old = kit.make_pod(FRACTION)
    old = {**old, "metadata": {**old["metadata"], "labels": {"team": "a", **before}}, "spec": {**old["spec"], "nodeName": "gpu-node-1"}}
    new = {**old, "metadata": {**old["metadata"], "labels": {"team": "a", **after}}}
    answer = Webhook(InjectionConfig(), "warn").handle(kit.review_of(new, operation="UPDATE", old=old))
    response = kit.response_of(answer)
    assert not response["allowed"] and response["status"]["code"] == 422, response
    assert "GPU-group labels of a bound pod cannot change" in response["status"]["message"] and not answer.record.published
    # Before the bind, KAI's binder sets them, and takes them off again when its bind fails.
    unbound = {**old, "spec": {k: v for k, v in old["spec"].items() if k != "nodeName"}}
    relabelled = {**new, "spec": unbound["spec"]}
    assert kit.response_of(Webhook(InjectionConfig(), "warn").handle(kit.review_of(relabelled, operation="UPDATE", old=unbound)))["allowed"]


@pytest.mark.parametrize("mode", ["warn", "enforce"])
@pytest.mark.parametrize(("before", "after"), [
    ({"gpu-memory": "4096"}, {"gpu-memory": "15000"}),
    ({"gpu-fraction": "0.25"}, {"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2"}),
    ({"gpu-fraction": "0.25", "runai/shared-gpu-configmap": "train-shared-gpu"}, {"gpu-fraction": "0.25", "runai/shared-gpu-configmap": "mine"}),
    ({"gpu-memory": "4096"}, {}),  # dropped: the pod would leave the webhook's match (and the grant its basis)
    ({}, {"gpu-memory": "4096"}),  # added to a pod created without: KAI would place a share the webhook never injected
])
def test_an_update_that_changes_the_gpu_request_is_refused_in_every_mode(kit: SimpleNamespace, mode: str, before: dict[str, str],
                                                                          after: dict[str, str]) -> None:
    webhook = Webhook(InjectionConfig(), mode)  # type: ignore[arg-type]
    answer = webhook.handle(kit.review_of(kit.make_pod(after), operation="UPDATE", old=kit.make_pod(before)))
    response = kit.response_of(answer)
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert "cannot change once it exists" in response["status"]["message"]
    assert answer.record.decision == "denied" and not answer.record.published


def test_an_update_without_the_pod_before_it_is_refused_clearly(kit: SimpleNamespace, webhook: Webhook) -> None:
    review = orjson.loads(kit.review_of(kit.make_pod(FRACTION), operation="UPDATE"))
    del review["request"]["oldObject"]
    response = kit.response_of(webhook.handle(orjson.dumps(review)))
    assert response["allowed"] is False and "oldObject" in response["status"]["message"]


def test_other_kinds_are_allowed_untouched(kit: SimpleNamespace, webhook: Webhook) -> None:
    answer = webhook.handle(kit.review_of({"kind": "ConfigMap", "metadata": {"annotations": FRACTION}}, kind="ConfigMap"))
    assert kit.response_of(answer) == {"uid": "uid-1", "allowed": True}
    assert answer.record.reason.startswith("not a Pod")


def test_configured_grant_dir_is_mounted_read_only_per_container(kit: SimpleNamespace) -> None:
    config = InjectionConfig(grant_dir="/srv/grants")
    view = read_pod(kit.make_pod({**FRACTION, "gpu-fraction-container-name": "gpu"}, ["sidecar", "gpu"]))
    ops = patch_ops(view, find_target(view), config)
    assert {"name": GRANT_VOLUME, "hostPath": {"path": "/srv/grants", "type": "DirectoryOrCreate"}} in ops[0]["value"]
    assert grant_mount("gpu") in kit.ops_for(ops, "/spec/containers/1/volumeMounts")[0]["value"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"grant_dir": "grants"}, "absolute path"),
    ({"grant_dir": "/"}, "must not be /"),
    ({"grant_dir": "/var/lib/kai-isolator/containers/g"}, "grant_dir /var/lib/kai-isolator/containers/g and state_dir"),
    ({"grant_dir": "/var/lib"}, "must not contain each other"),
    ({"grant_dir": "/usr/local/vgpu/grants"}, "and container_vgpu_mount /usr/local/vgpu must not contain each other"),
])
def test_a_grant_dir_inside_or_around_the_state_or_library_dir_is_refused(fields: dict[str, str], message: str) -> None:
    from pydantic import ValidationError

    from kai_isolator.services.admission.settings import AdmissionSettings

    with pytest.raises(ValidationError, match=message):
        AdmissionSettings(**fields)
    assert AdmissionSettings(grant_dir="/var/lib/kai-isolator/grants/").grant_dir == "/var/lib/kai-isolator/grants"
