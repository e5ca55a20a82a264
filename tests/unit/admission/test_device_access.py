"""A pod outside GPU sharing that names GPUs for the NVIDIA runtime (issue 45): refused under enforce, warned about
under warn, let be under off; a container that asks the device plugin for a GPU, and KAI's reservation pods, never."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.settings import PolicyMode
from kai_isolator.services.admission.webhook import Answer, Webhook
from kai_isolator.shared.contract import RESERVATION_NAMESPACE

SHARED_GPU = "GPU-0000fa4e-1111-2222-3333-000000000000"


def plain(kit: SimpleNamespace, env: list[dict[str, Any]], *, init: bool = False, resources: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pod as a tenant writes it: no gpu-fraction or gpu-memory, the default scheduler, one container (or an init one)."""
    pod = kit.make_pod(None, ["cuda"], inits=["setup"] if init else None, seccomp=None)
    container = pod["spec"]["initContainers" if init else "containers"][0]
    container["env"] = env
    if resources is not None:
        container["resources"] = resources
    return pod


def answer(kit: SimpleNamespace, pod: dict[str, Any], mode: PolicyMode) -> tuple[Answer, dict[str, Any]]:
    given = Webhook(InjectionConfig(), mode).handle(kit.review_of(pod))
    return given, kit.response_of(given)


NAMING = {
    "all": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
    "the shared GPU's UUID": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": SHARED_GPU}],
    "an index": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}],
    "a ConfigMap key": [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "mine", "key": "gpus"}}}],
    "void, then all (the last wins)": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
}


@pytest.mark.parametrize("init", [False, True], ids=["container", "init container"])
@pytest.mark.parametrize("case", NAMING)
def test_enforce_refuses_a_pod_outside_gpu_sharing_that_names_gpus(kit: SimpleNamespace, case: str, init: bool) -> None:
    given, response = answer(kit, plain(kit, NAMING[case], init=init), "enforce")
    assert response["allowed"] is False and response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith("kai-resource-isolator denies this pod, which shares no GPU: container ")
    assert "sets NVIDIA_VISIBLE_DEVICES but asks for no nvidia.com/gpu" in message
    assert given.record is not None and given.record.decision == "denied" and given.record.findings


def test_warn_admits_it_unchanged_with_the_finding_as_a_warning(kit: SimpleNamespace) -> None:
    given, response = answer(kit, plain(kit, NAMING["all"]), "warn")
    assert response["allowed"] is True and "patch" not in response
    assert [w for w in response["warnings"] if "container cuda sets NVIDIA_VISIBLE_DEVICES" in w]
    assert given.record is not None and given.record.decision == "warned"


def test_off_lets_it_be(kit: SimpleNamespace) -> None:
    given, response = answer(kit, plain(kit, NAMING["all"]), "off")
    assert response["allowed"] is True and "warnings" not in response and given.record.decision == "skipped"


@pytest.mark.parametrize("value", ["void", "none", "", "NONE"])
def test_a_container_that_asks_for_no_gpu_is_admitted(kit: SimpleNamespace, value: str) -> None:
    given, response = answer(kit, plain(kit, [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": value}]),
                             "enforce")
    assert response["allowed"] is True and "warnings" not in response and "patch" not in response


@pytest.mark.parametrize("resources", [{"limits": {"nvidia.com/gpu": "1"}}, {"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 2}},
                                       {"limits": {"nvidia.com/mig-1g.10gb": "1"}}], ids=["whole GPU", "two GPUs", "a MIG slice"])
def test_a_container_that_asks_the_device_plugin_is_out_of_scope(kit: SimpleNamespace, resources: dict[str, Any]) -> None:
    _, response = answer(kit, plain(kit, NAMING["all"], resources=resources), "enforce")
    assert response["allowed"] is True and "warnings" not in response


@pytest.mark.parametrize("zero", ["0", "0.0", "0m", 0, "0e3"])
def test_asking_for_zero_gpus_is_asking_for_none(kit: SimpleNamespace, zero: object) -> None:
    _, response = answer(kit, plain(kit, NAMING["all"], resources={"limits": {"nvidia.com/gpu": zero}}), "enforce")
    assert response["allowed"] is False


def test_a_sibling_of_a_whole_gpu_container_is_judged_on_its_own(kit: SimpleNamespace) -> None:
    """The device plugin hands GPUs per container: a sibling that names every GPU itself gets them past it."""
    pod = kit.make_pod(None, ["trainer", "sidecar"], seccomp=None)
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    pod["spec"]["containers"][1]["env"] = NAMING["all"]
    _, response = answer(kit, pod, "enforce")
    assert response["allowed"] is False and "container sidecar sets NVIDIA_VISIBLE_DEVICES" in response["status"]["message"]
    assert "trainer" not in response["status"]["message"]


def test_kais_reservation_pod_is_admitted(kit: SimpleNamespace) -> None:
    """KAI's binder makes its reservation pods asking the device plugin for the GPU (resource_reservation.go), so the GPU
    comes to them from the plugin, whatever they name."""
    pod = kit.make_pod(None, ["resource-reservation"], seccomp=None)
    pod["metadata"].update(namespace=RESERVATION_NAMESPACE, labels={"app": RESERVATION_NAMESPACE, "runai-gpu-group": "g"})
    pod["spec"]["containers"][0].update(resources={"limits": {"nvidia.com/gpu": "1"}}, env=[
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}, *NAMING["all"]])
    _, response = answer(kit, pod, "enforce")
    assert response["allowed"] is True and "warnings" not in response


def test_env_from_sources_are_left_to_the_node(kit: SimpleNamespace) -> None:
    """What a ConfigMap or Secret will hold when the container starts is not in the review (and may change after it):
    the webhook does not judge it; the node agent's enforcer does, from the driver (docs/security.md, row 35)."""
    pod = plain(kit, [])
    pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "gpus"}}]
    _, response = answer(kit, pod, "enforce")
    assert response["allowed"] is True and "warnings" not in response


def test_a_pod_that_names_no_gpu_is_skipped_as_before(kit: SimpleNamespace) -> None:
    given, response = answer(kit, plain(kit, [{"name": "HOME", "value": "/root"}]), "enforce")
    assert response["allowed"] is True and given.record.decision == "skipped"
    assert given.record.reason == "not a GPU-sharing pod (no gpu-fraction or gpu-memory annotation)"
