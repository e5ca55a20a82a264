"""Differential: the same pods through the real KAI-Scheduler admission (built from its source archive, run with the
operator's flags against a real kube-apiserver) and through our simulation (services/devcluster/kai.py); what each
leaves on the pod, or its refusal, must be the same apart from the random part of the ConfigMap names.

Both sides go through the same API server: the real KAI in namespace `tenant`, the simulated one's result created
(dry run) in `kai-scheduler`, which KAI's webhooks leave alone, so both get the same defaulting.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kai_isolator.services.devcluster.kai import ADMISSION_WEBHOOK, CONFIGMAP_ANNOTATION, KAI_NAMESPACE, KaiOptions, KaiRefused, kai_admit
from kai_isolator.services.devcluster.plane import ApiCallError, ControlPlane
from kai.real_kai import TENANT, RealKaiAdmission, answered_by, dry_run_create, real_admission, until_in_force

pytestmark = pytest.mark.timeout(600)  # the first run builds KAI's admission (minutes); the cache makes it seconds after
Obj = dict[str, Any]
_RANDOM = re.compile(r"-([bcdfghjklmnpqrstvwxz2456789]{7})-shared-gpu")
_TOKEN_VOLUME = re.compile(r"kube-api-access-[a-z0-9]{5}")  # the ServiceAccount admission's random volume name
_VOLATILE = ("uid", "creationTimestamp", "namespace", "resourceVersion", "managedFields", "generation")


def pod(name: str, annotations: dict[str, str] | None = None, containers: tuple[str, ...] = ("main",), inits: tuple[str, ...] = (),
        scheduler: str | None = "kai-scheduler", **spec: Any) -> Obj:
    body: Obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": dict(annotations or {})},
                 "spec": {"containers": [{"name": c, "image": "busybox"} for c in containers], **spec}}
    if inits:
        body["spec"]["initContainers"] = [{"name": c, "image": "busybox"} for c in inits]
    if scheduler:
        body["spec"]["schedulerName"] = scheduler
    return body


def _with(body: Obj, container: int = 0, **fields: Any) -> Obj:
    body["spec"]["containers"][container].update(fields)
    return body


def _owned(body: Obj, owner: str) -> Obj:
    body["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": owner, "uid": "0b5f9a9e-1111-2222-3333-444455556666"}]
    return body


CASES: dict[str, Obj] = {
    "gpu-memory": pod("memory", {"gpu-memory": "4096"}),
    "gpu-fraction": pod("fraction", {"gpu-fraction": "0.5"}),
    "init-container target": pod("init", {"gpu-fraction": "0.5", "gpu-fraction-container-name": "setup"}, inits=("setup",)),
    "second container target": pod("second", {"gpu-memory": "2048", "gpu-fraction-container-name": "worker"}, containers=("main", "worker")),
    "several devices": pod("multi", {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}),
    "default scheduler": pod("default", {"gpu-memory": "4096"}, scheduler=None),
    "no GPU request": pod("plain"),
    "tenant's own ConfigMap name": pod("named", {"gpu-memory": "4096", CONFIGMAP_ANNOTATION: "mine"}),
    "tenant env and envFrom kept, KAI's names replaced": _with(
        pod("env", {"gpu-fraction": "0.25"}), env=[{"name": "GPU_PORTION", "value": "1"}, {"name": "KEEP", "value": "x"},
                                                   {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
        envFrom=[{"configMapRef": {"name": "team-settings"}}]),
    "owner's long name cut": _owned(pod("owned-pod", {"gpu-fraction": "0.5"}), "a-training-job-with-a-rather-long-name-for-its-pods"),
    "own runtime class kept": pod("runtime", {"gpu-fraction": "0.5"}, runtimeClassName="custom"),
    "bad: gpu-memory not an integer": pod("bad-memory", {"gpu-memory": "4096.5"}),
    "bad: gpu-memory zero": pod("bad-zero", {"gpu-memory": "0"}),
    "bad: fraction above 1": pod("bad-big", {"gpu-fraction": "1.5"}),
    "bad: fraction 1": pod("bad-one", {"gpu-fraction": "1"}),
    "bad: fraction zero": pod("bad-nought", {"gpu-fraction": "0"}),
    "bad: fraction not a number": pod("bad-text", {"gpu-fraction": "half"}),
    "bad: fraction and a whole GPU": _with(pod("bad-whole", {"gpu-fraction": "0.5"}), resources={"limits": {"nvidia.com/gpu": "1"}}),
    "bad: memory and fraction": pod("bad-both", {"gpu-fraction": "0.5", "gpu-memory": "1024"}),
    "bad: zero devices": pod("bad-devices", {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "0"}),
    "bad: devices without a share": pod("bad-count", {"gpu-fraction-num-devices": "2"}),
    "bad: no such container": pod("bad-target", {"gpu-memory": "1024", "gpu-fraction-container-name": "sidecar"}),
}
HAMICORE_OFF_CASES = ("gpu-memory", "init-container target", "several devices")


def normalised(body: Obj) -> Obj:
    """The pod as stored, its volatile metadata dropped and the random part of KAI's ConfigMap names masked."""
    body = copy.deepcopy(body)
    for key in _VOLATILE:
        body["metadata"].pop(key, None)
    # The order of volumes means nothing, and differs here only because the simulated side meets the API server's
    # ServiceAccount admission after KAI's volume is in, where the real side met it before.
    body["spec"]["volumes"] = sorted(body["spec"].get("volumes") or [], key=lambda v: str(v.get("name")))
    text = _TOKEN_VOLUME.sub("kube-api-access-RANDOM", json.dumps(body))
    found = _RANDOM.search(str((body["metadata"].get("annotations") or {}).get(CONFIGMAP_ANNOTATION, "")))
    return json.loads(text.replace(found.group(1), "RANDOM7") if found else text)  # type: ignore[no-any-return]


def differences(simulated: Any, real: Any, path: str = "") -> list[str]:
    """Where two JSON values differ, one line per place: `path: simulated != real`."""
    if isinstance(simulated, dict) and isinstance(real, dict):
        return [d for k in sorted(set(simulated) | set(real), key=str)
                for d in differences(simulated.get(k, "<absent>"), real.get(k, "<absent>"), f"{path}/{k}")]
    if isinstance(simulated, list) and isinstance(real, list) and len(simulated) == len(real):
        return [d for i, (a, b) in enumerate(zip(simulated, real)) for d in differences(a, b, f"{path}/{i}")]
    return [] if simulated == real else [f"{path or '/'}: simulation {simulated!r} != real KAI {real!r}"]


def outcome_of_real(plane: ControlPlane, body: Obj) -> Obj:
    try:
        return {"pod": normalised(dry_run_create(plane, TENANT, body))}
    except ApiCallError as error:
        return {"refused": error.code, "message": str(error.status.get("message"))}


def outcome_of_simulation(plane: ControlPlane, body: Obj, options: KaiOptions) -> Obj:
    try:
        admitted = kai_admit(body, options)
    except KaiRefused as error:
        return {"refused": 403, "message": f'admission webhook "{ADMISSION_WEBHOOK}" denied the request: {error}'}
    return {"pod": normalised(dry_run_create(plane, KAI_NAMESPACE, admitted))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_simulation_admits_as_the_real_kai(kai_plane: ControlPlane, seed_kai: RealKaiAdmission, case: str) -> None:
    real = outcome_of_real(kai_plane, CASES[case])
    simulated = outcome_of_simulation(kai_plane, CASES[case], KaiOptions())
    assert differences(simulated, real) == [], f"{case}: the simulation differs from KAI's admission (log: {seed_kai.log_path})"


def test_the_real_kai_adds_what_the_policy_was_written_against(kai_plane: ControlPlane, seed_kai: RealKaiAdmission) -> None:
    """The shape tests/unit/admission/test_kai_admitted.py spells from KAI's source, seen on the real one."""
    stored = dry_run_create(kai_plane, TENANT, CASES["gpu-memory"])
    prefix = stored["metadata"]["annotations"][CONFIGMAP_ANNOTATION]
    main = stored["spec"]["containers"][0]
    assert main["envFrom"] == [{"configMapRef": {"name": f"{prefix}-0-evar", "optional": False}}]
    assert [(e["name"], e["valueFrom"]["configMapKeyRef"]) for e in main["env"]] == [
        ("NVIDIA_VISIBLE_DEVICES", {"name": f"{prefix}-0", "key": "NVIDIA_VISIBLE_DEVICES"}),
        ("RUNAI_NUM_OF_GPUS", {"name": f"{prefix}-0", "key": "RUNAI_NUM_OF_GPUS"}),
        ("GPU_PORTION", {"name": f"{prefix}-0", "key": "GPU_PORTION"}),
        ("CUDA_DEVICE_MEMORY_LIMIT", {"name": f"{prefix}-0", "key": "CUDA_DEVICE_MEMORY_LIMIT", "optional": True})]
    assert stored["spec"]["runtimeClassName"] == "nvidia"
    assert {"name": f"{prefix}-0-vol", "configMap": {"name": f"{prefix}-0", "defaultMode": 420}} in stored["spec"]["volumes"]


def test_without_hamicore_the_real_kai_and_the_simulation_set_no_limit(kai_plane: ControlPlane, seed_kai: RealKaiAdmission,
                                                                       tmp_path: Path) -> None:
    seed_kai.unregister()
    try:
        for kai in real_admission(kai_plane, tmp_path, hamicore=False):
            for case in HAMICORE_OFF_CASES:
                real = outcome_of_real(kai_plane, CASES[case])
                assert "CUDA_DEVICE_MEMORY_LIMIT" not in repr(real), case
                simulated = outcome_of_simulation(kai_plane, CASES[case], KaiOptions(hamicore=False))
                assert differences(simulated, real) == [], f"{case} (log: {kai.log_path})"
    finally:
        seed_kai.register()
        until_in_force(kai_plane, TENANT, answered_by(True), "KAI's admission (seed) again")
