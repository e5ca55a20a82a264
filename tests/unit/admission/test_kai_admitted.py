"""The policy on pods exactly as real KAI-Scheduler's admission leaves them, in the API server's real webhook order:
ours (`kai-resource-isolator-mutating`) first, KAI's (`mutating-kai-admission`) after it, ours again (reinvocation).

`kai_admission_mutate` spells, from KAI's source at d5bc503 (third_party/kai-scheduler), what its admission plugins do
to a GPU-sharing pod with the seed's settings (gpuSharing, hamicore): gpusharing.Mutate
(pkg/admission/webhook/v1alpha2/gpusharing, pkg/binder/common/{env_vars,volumes}.go, gpusharingconfigmap), then
hamicore.Mutate, then runtimeenforcement (runtime class `nvidia`). KAI appends env after removing any same-named entry.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import jsonpatch
import pytest

from kai_isolator.shared.contract import GRANT_VOLUME
from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.settings import PolicyMode
from kai_isolator.services.admission.webhook import Webhook

Obj = dict[str, Any]
PREFIX = "test-pod-x7k2q9b-shared-gpu"  # KAI: <base>-<7 random chars>-shared-gpu


def _ref(configmap: str, key: str, optional: bool | None = None) -> Obj:
    ref: Obj = {"name": configmap, "key": key}
    if optional is not None:
        ref["optional"] = optional
    return {"name": key, "valueFrom": {"configMapKeyRef": ref}}


def kai_admission_mutate(pod: Obj, prefix: str = PREFIX, hamicore: bool = True) -> Obj:
    """The pod after KAI's mutating webhook, as its source does it (see the module docstring)."""
    pod = copy.deepcopy(pod)
    annotations = pod["metadata"].setdefault("annotations", {})
    annotations.setdefault("runai/shared-gpu-configmap", prefix)
    prefix = annotations["runai/shared-gpu-configmap"]
    wanted = annotations.get("gpu-fraction-container-name")
    field, index = "containers", 0
    if wanted:
        field, index = next((f, i) for f in ("initContainers", "containers") for i, c in enumerate(pod["spec"].get(f) or [])
                            if c["name"] == wanted)
    container = pod["spec"][field][index]
    capabilities = f"{prefix}-{'i' if field == 'initContainers' else ''}{index}"
    added = [_ref(capabilities, "NVIDIA_VISIBLE_DEVICES"), _ref(capabilities, "RUNAI_NUM_OF_GPUS"), _ref(capabilities, "GPU_PORTION")]
    if hamicore:
        added.append(_ref(capabilities, "CUDA_DEVICE_MEMORY_LIMIT", optional=True))
    for entry in added:  # common.AddEnvVarToContainer: drop any same-named entry, append
        container["env"] = [e for e in container.get("env") or [] if e["name"] != entry["name"]] + [entry]
    volume_name = f"{capabilities}-vol"
    volumes = [v for v in pod["spec"].get("volumes") or [] if v["name"] != volume_name]
    pod["spec"]["volumes"] = volumes + [{"name": volume_name, "configMap": {"name": capabilities, "defaultMode": 420}}]
    evar = f"{capabilities}-evar"
    if not any((s.get("configMapRef") or {}).get("name") == evar for s in container.get("envFrom") or []):
        container["envFrom"] = (container.get("envFrom") or []) + [{"configMapRef": {"name": evar, "optional": False}}]
    pod["spec"].setdefault("runtimeClassName", "nvidia")
    return pod


def our_pass(kit: SimpleNamespace, pod: Obj, mode: PolicyMode) -> tuple[Obj, Obj, Any]:
    """One call of our webhook: its response, the pod with the patch applied, and the decision record."""
    answer = Webhook(InjectionConfig(), mode).handle(kit.review_of(pod))
    response = kit.response_of(answer)
    patched = jsonpatch.apply_patch(pod, kit.patch_of(answer)) if response["allowed"] else pod
    return response, patched, answer.record


def in_real_order(kit: SimpleNamespace, pod: Obj, mode: PolicyMode) -> tuple[Obj, Obj, Any]:
    """Ours, then KAI's, then ours again: the reinvocation's answer and the pod as it is stored."""
    first, pod, record = our_pass(kit, pod, mode)
    assert first["allowed"] is True and record.findings == (), first
    return our_pass(kit, kai_admission_mutate(pod), mode)


def seed_pod(kit: SimpleNamespace, **annotations: str) -> Obj:
    pod = kit.make_pod({"gpu-memory": "4096", **annotations}, ["main"])
    pod["spec"]["schedulerName"] = "kai-scheduler"
    return pod


@pytest.mark.parametrize("mode", ["warn", "enforce"])
def test_a_kai_admitted_pod_passes_the_reinvocation_with_no_finding_and_no_change(kit: SimpleNamespace, mode: PolicyMode) -> None:
    response, stored, record = in_real_order(kit, seed_pod(kit), mode)
    assert response["allowed"] is True and "warnings" not in response, response
    assert record.findings == () and record.decision == "skipped"  # already injected: the patch is empty
    main = stored["spec"]["containers"][0]
    assert main["envFrom"] == [{"configMapRef": {"name": f"{PREFIX}-0-evar", "optional": False}}]
    assert {m["name"] for m in main["volumeMounts"]} >= {GRANT_VOLUME}  # the grant that makes KAI's env harmless


@pytest.mark.parametrize("mode", ["warn", "enforce"])
def test_a_kai_admitted_init_container_target_uses_its_i_index(kit: SimpleNamespace, mode: PolicyMode) -> None:
    pod = kit.make_pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "setup"}, ["main"], inits=["setup"])
    response, stored, record = in_real_order(kit, pod, mode)
    assert response["allowed"] is True and record.findings == ()
    assert stored["spec"]["initContainers"][0]["envFrom"] == [{"configMapRef": {"name": f"{PREFIX}-i0-evar", "optional": False}}]


@pytest.mark.parametrize("mode", ["warn", "enforce"])
def test_kai_first_then_ours_is_also_clean(kit: SimpleNamespace, mode: PolicyMode) -> None:
    """Were KAI's configuration to sort first (a renamed one), our single call still sees a clean pod."""
    response, _, record = our_pass(kit, kai_admission_mutate(seed_pod(kit)), mode)
    assert response["allowed"] is True and record.findings == () and "warnings" not in response


def _with_env_from(pod: Obj, *sources: Obj) -> Obj:
    pod["spec"]["containers"][0]["envFrom"] = [*pod["spec"]["containers"][0]["envFrom"], *sources]
    return pod


KAIS = {"configMapRef": {"name": f"{PREFIX}-0-evar", "optional": False}}
TENANT_SOURCES = {
    "another configmap": ({"configMapRef": {"name": "evil"}}, "configMapRef evil"),
    "KAI's name with a prefix": ({**KAIS, "prefix": "LD_"}, "with prefix 'LD_'"),
    "KAI's name, optional": ({"configMapRef": {"name": f"{PREFIX}-0-evar", "optional": True}}, f"configMapRef {PREFIX}-0-evar (optional)"),
    "KAI's name as a secret": ({"secretRef": {"name": f"{PREFIX}-0-evar"}}, f"secretRef {PREFIX}-0-evar"),
    "another index's": ({"configMapRef": {"name": f"{PREFIX}-1-evar"}}, f"configMapRef {PREFIX}-1-evar"),
}


@pytest.mark.parametrize("case", sorted(TENANT_SOURCES))
def test_a_tenant_source_beside_kais_is_still_a_finding(kit: SimpleNamespace, case: str) -> None:
    source, phrase = TENANT_SOURCES[case]
    _, stored, _ = our_pass(kit, seed_pod(kit), "enforce")
    pod = _with_env_from(kai_admission_mutate(stored), source)
    denied, _, record = our_pass(kit, pod, "enforce")
    assert denied["allowed"] is False and "container main takes env from envFrom sources the webhook cannot check" in denied["status"]["message"]
    assert phrase in denied["status"]["message"] and f"{PREFIX}-0-evar, " not in denied["status"]["message"]
    warned, _, _ = our_pass(kit, pod, "warn")
    assert warned["allowed"] is True and any(phrase in w for w in warned["warnings"])


def test_kais_shape_without_the_annotation_naming_it_is_a_finding(kit: SimpleNamespace) -> None:
    pod = seed_pod(kit)
    pod["spec"]["containers"][0]["envFrom"] = [KAIS]
    response, _, _ = our_pass(kit, pod, "enforce")
    assert response["allowed"] is False and f"configMapRef {PREFIX}-0-evar" in response["status"]["message"]


def test_a_tenant_that_writes_kais_annotation_and_envfrom_itself_gets_no_more_than_kai_gives(kit: SimpleNamespace) -> None:
    """The tenant controls the annotation and its ConfigMaps either way: the same envFrom, written by the tenant before
    KAI saw the pod, is KAI's (KAI does not add it twice) and is admitted under the same grant."""
    pod = seed_pod(kit, **{"runai/shared-gpu-configmap": "mine"})
    pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "mine-0-evar"}}]
    response, stored, record = in_real_order(kit, pod, "enforce")
    assert response["allowed"] is True and record.findings == ()
    assert stored["spec"]["containers"][0]["envFrom"] == [{"configMapRef": {"name": "mine-0-evar"}}]


def test_a_sidecar_with_kais_envfrom_is_still_a_finding(kit: SimpleNamespace) -> None:
    """KAI gives only the fraction container an envFrom; on any other it may set NVIDIA_VISIBLE_DEVICES unlimited."""
    pod = seed_pod(kit)
    pod["spec"]["containers"].append({"name": "sidecar", "image": "busybox", "envFrom": [KAIS]})
    _, stored, _ = our_pass(kit, pod, "warn")
    response, _, _ = our_pass(kit, kai_admission_mutate(stored), "enforce")
    assert response["allowed"] is False and "container sidecar takes env from envFrom" in response["status"]["message"]
