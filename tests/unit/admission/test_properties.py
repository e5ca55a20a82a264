"""Properties over generated pods: never a 5xx, every patch applies to its pod, the patched pod is a
valid Kubernetes Pod (strict schema) whose target mounts its grant read-only, mutating it again changes
nothing, the readiness-gated path adds exactly its one gate, `enforce` never admits a target without
a confining seccomp profile, the patch served ready-made to a pod that carries nothing of ours is the
one computed for it, and an answer replayed for a body that differs only in its uid is the answer a
fresh webhook gives."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import jsonpatch
import kubernetes_validate
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kai_isolator.shared.contract import GRANT_VOLUME, STATE_VOLUME, VGPU_VOLUME
from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.mutation import patch_ops, readiness_gate_ops
from kai_isolator.services.admission.pod import NoTargetContainer, PodUnreadable, find_target, read_pod
from kai_isolator.services.admission.webhook import Webhook

K8S_VERSION = "1.33"
CONTAINER_NAMES = ["main", "sidecar", "gpu-workload", "setup", "logger"]
VOLUME_NAMES = [VGPU_VOLUME, STATE_VOLUME, GRANT_VOLUME, "data", "config", "scratch"]
MOUNT_PATHS = ["/data", "/etc/ld.so.preload", "/etc/./ld.so.preload", "/usr/local/vgpu", "/usr/local/vgpu/libvgpu.so",
               "/run/kai-isolator", "/var/cache", "/etc", "/usr/local/vgpu/", "/etc/kai-isolator", "/etc/kai-isolator/grant.json"]
ENV_NAMES = ["POD_UID", "CONTAINER_NAME", "CONTAINER_VGPU_MOUNT", "CUDA_DEVICE_MEMORY_SHARED_CACHE", "LD_PRELOAD",
             "CUDA_DISABLE_CONTROL", "PATH", "HOME", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MEMORY_LIMIT_0"]
SECCOMP = [None, {"type": "RuntimeDefault"}, {"type": "Localhost", "localhostProfile": "profiles/p.json"}, {"type": "Unconfined"}]
CONFINING = {"RuntimeDefault", "Localhost"}

volume_sources = st.sampled_from([
    {"emptyDir": {}},
    {"configMap": {"name": "cfg"}},
    {"hostPath": {"path": "/usr/local/vgpu", "type": "DirectoryOrCreate"}},
    {"hostPath": {"path": "/var/lib/kai-isolator/containers", "type": "DirectoryOrCreate"}},
    {"hostPath": {"path": "/var/lib/kai-isolator/grants", "type": "DirectoryOrCreate"}},
    {"hostPath": {"path": "/usr/local", "type": ""}},
    {"hostPath": {"path": "/tmp"}},
])


def env_var(name: str) -> st.SearchStrategy[dict[str, Any]]:
    downward = {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}}
    return st.one_of(
        st.builds(lambda v: {"name": name, "value": v}, st.sampled_from(["", "x", "/usr/local/vgpu", "main", "/tmp/c"])),
        st.just({"name": name, **downward}),
    )


mounts = st.lists(
    st.builds(lambda n, p, ro, sub: {"name": n, "mountPath": p, **({"readOnly": ro} if ro is not None else {}), **({"subPath": sub} if sub else {})},
              st.sampled_from(VOLUME_NAMES), st.sampled_from(MOUNT_PATHS), st.sampled_from([None, True, False]),
              st.sampled_from(["", "ld.so.preload"])),
    max_size=4, unique_by=lambda m: m["mountPath"],
)


@st.composite
def containers(draw: st.DrawFn, names: list[str]) -> list[dict[str, Any]]:
    result = []
    for name in names:
        container: dict[str, Any] = {"name": name, "image": "busybox"}
        if draw(st.booleans()):
            container["volumeMounts"] = draw(mounts)
        if draw(st.booleans()):
            env_names = draw(st.lists(st.sampled_from(ENV_NAMES), max_size=4))
            container["env"] = [draw(env_var(n)) for n in env_names]
        security: dict[str, Any] = {}
        if draw(st.integers(0, 5)) == 0:
            security["privileged"] = draw(st.booleans())
        seccomp = draw(st.sampled_from(SECCOMP))
        if seccomp is not None:
            security["seccompProfile"] = seccomp
        if security:
            container["securityContext"] = security
        result.append(container)
    return result


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(CONTAINER_NAMES), min_size=1, max_size=4, unique=True))
    split = draw(st.integers(0, len(names) - 1))
    inits, regular = names[:split], names[split:]
    annotations: dict[str, str] = {}
    if draw(st.booleans()):
        annotations[draw(st.sampled_from(["gpu-fraction", "gpu-memory"]))] = draw(st.sampled_from(["0.5", "4096"]))
    if draw(st.booleans()):
        annotations["gpu-fraction-container-name"] = draw(st.sampled_from(CONTAINER_NAMES))
    if draw(st.integers(0, 4)) == 0:
        annotations["kai-resource-isolator.io/inject"] = draw(st.sampled_from(["false", "FALSE", "true"]))
    spec: dict[str, Any] = {"containers": draw(containers(regular))}
    pod_seccomp = draw(st.sampled_from(SECCOMP))
    if pod_seccomp is not None:
        spec["securityContext"] = {"seccompProfile": pod_seccomp}
    if inits:
        spec["initContainers"] = draw(containers(inits))
    if draw(st.booleans()):
        volume_names = draw(st.lists(st.sampled_from(VOLUME_NAMES), max_size=4, unique=True))
        spec["volumes"] = [{"name": n, **draw(volume_sources)} for n in volume_names]
    metadata: dict[str, Any] = {"name": "test-pod", "namespace": "test-ns"}
    if annotations or draw(st.booleans()):
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def review(pod: dict[str, Any]) -> bytes:
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                         "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                     "operation": "CREATE", "namespace": "test-ns", "object": pod}})


def target_of(pod: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The fraction container as KAI resolves it (init containers first), with the list it is in."""
    spec, wanted = pod["spec"], pod["metadata"].get("annotations", {}).get("gpu-fraction-container-name")
    if wanted is None:
        return "containers", spec["containers"][0]
    for field in ("initContainers", "containers"):
        for container in spec.get(field, []):
            if container["name"] == wanted:
                return field, container
    return None


def seccomp_of(pod: dict[str, Any], container: dict[str, Any]) -> str | None:
    own = container.get("securityContext", {}).get("seccompProfile", {}).get("type")
    return own or pod["spec"].get("securityContext", {}).get("seccompProfile", {}).get("type")


def respond(webhook: Webhook, pod: dict[str, Any]) -> dict[str, Any]:
    answer = webhook.handle(review(pod))
    assert answer.status < 500
    response = orjson.loads(answer.body)["response"]
    assert response.get("status", {}).get("code", 200) < 500, response
    return response


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pod=pods(), mode=st.sampled_from(["warn", "off", "enforce"]), gated=st.booleans())
def test_patches_apply_validate_and_are_idempotent(pod: dict[str, Any], mode: str, gated: bool) -> None:
    webhook = Webhook(InjectionConfig(), mode, readiness_gate=gated)  # type: ignore[arg-type]
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)  # the generator makes valid pods only
    response = respond(webhook, pod)
    target = target_of(pod)
    if mode == "enforce" and response["allowed"] and "patch" in response and target is not None:
        assert seccomp_of(pod, target[1]) in CONFINING, "enforce admitted a target without a confining seccomp profile"
    if "patch" not in response:
        return
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = orjson.loads(base64.b64decode(response["patch"]))
    patched = jsonpatch.JsonPatch(ops).apply(pod)
    try:
        kubernetes_validate.validate(patched, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        raise AssertionError(f"patched pod is not a valid Pod: {str(error).splitlines()[0]}") from None
    assert target is not None
    field, container = target
    name = container["name"]
    patched_target = next(c for c in patched["spec"][field] if c["name"] == name)
    at_grant = [m for m in patched_target.get("volumeMounts", []) if m["mountPath"].rstrip("/") == "/etc/kai-isolator"]
    assert all(m.get("readOnly") is True for m in patched_target.get("volumeMounts", []) if m["name"] == GRANT_VOLUME)
    if field == "containers":
        assert at_grant == [{"name": GRANT_VOLUME, "mountPath": "/etc/kai-isolator", "subPathExpr": f"$(POD_UID)_{name}", "readOnly": True}]
        (volume,) = [v for v in patched["spec"]["volumes"] if v["name"] == GRANT_VOLUME]
        assert volume == {"name": GRANT_VOLUME, "hostPath": {"path": "/var/lib/kai-isolator/grants", "type": "DirectoryOrCreate"}}
    for other in (c for f in ("initContainers", "containers") for c in patched["spec"].get(f, []) if c is not patched_target):
        assert all(m.get("readOnly") is True for m in other.get("volumeMounts", []) if m["name"] == GRANT_VOLUME), "another container may write a grant"
    gates = [g["conditionType"] for g in patched["spec"].get("readinessGates", [])]
    assert gates == (["kai-resource-isolator.io/Isolated"] if gated else []), gates  # the generator sets no gates of its own
    again = respond(webhook, patched)
    assert "patch" not in again, orjson.loads(base64.b64decode(again["patch"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pod=pods(), mode=st.sampled_from(["warn", "off", "enforce"]), gated=st.booleans())
def test_replaying_never_changes_an_answer(pod: dict[str, Any], mode: str, gated: bool) -> None:
    webhook = Webhook(InjectionConfig(), mode, readiness_gate=gated)  # type: ignore[arg-type]
    for _ in range(3):  # learned, verified, replayed
        raw = review(pod).replace(b'"uid":"u"', f'"uid":"{uuid.uuid4()}"'.encode(), 1)
        assert webhook.handle(raw) == Webhook(InjectionConfig(), mode, readiness_gate=gated).handle(raw)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pod=pods(), gated=st.booleans())
def test_every_patch_is_the_one_computed_for_the_pod(pod: dict[str, Any], gated: bool) -> None:
    """Through the webhook twice (the second time the shape's patch is ready-made) and by patch_ops."""
    webhook = Webhook(InjectionConfig(), "off", readiness_gate=gated)
    try:
        view = read_pod(pod)
        target = find_target(view)
    except (PodUnreadable, NoTargetContainer):
        return
    expected = patch_ops(view, target, InjectionConfig()) + (readiness_gate_ops(view) if gated else [])
    for _ in range(2):
        response = respond(webhook, pod)
        if "patch" in response:  # not every pod is mutated (no annotation, opted out)
            assert orjson.loads(base64.b64decode(response["patch"])) == expected
