"""The NRI plugin a GPU-sharing pod's containers require (`KAI_ISOLATOR_REQUIRE_NRI_PLUGIN`): every container is annotated in the
scope NRI's default validator reads first, over whatever the tenant wrote there; other pods are never annotated."""

from __future__ import annotations

from types import SimpleNamespace

import jsonpatch

from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.mutation import REQUIRED_PLUGINS
from kai_isolator.services.admission.webhook import Webhook

KEY = f"{REQUIRED_PLUGINS}/container.main"  # make_pod's one container


def requiring() -> Webhook:
    return Webhook(InjectionConfig(), "warn", required_plugin="kai-isolator")


def test_each_container_requires_the_plugin_once(kit: SimpleNamespace) -> None:
    pod = kit.make_pod({"gpu-memory": "4096"})
    patched = jsonpatch.apply_patch(pod, kit.patch_of(requiring().handle(kit.review_of(pod))))
    names = [c["name"] for c in patched["spec"].get("initContainers", []) + patched["spec"]["containers"]]
    assert {k: v for k, v in patched["metadata"]["annotations"].items() if k.startswith(REQUIRED_PLUGINS)} == {
        f"{REQUIRED_PLUGINS}/container.{name}": '["kai-isolator"]' for name in names}
    assert kit.patch_of(requiring().handle(kit.review_of(patched))) == []  # idempotent


def test_a_tenants_own_container_scoped_value_is_overwritten(kit: SimpleNamespace) -> None:
    pod = kit.make_pod({"gpu-fraction": "0.5", KEY: "[]"})
    patched = jsonpatch.apply_patch(pod, kit.patch_of(requiring().handle(kit.review_of(pod))))
    assert patched["metadata"]["annotations"][KEY] == '["kai-isolator"]'


def test_without_the_setting_or_outside_gpu_sharing_nothing_is_required(kit: SimpleNamespace) -> None:
    pod = kit.make_pod({"gpu-memory": "4096"})
    plain = jsonpatch.apply_patch(pod, kit.patch_of(Webhook(InjectionConfig(), "warn").handle(kit.review_of(pod))))
    assert not any(k.startswith(REQUIRED_PLUGINS) for k in plain["metadata"]["annotations"])
    assert kit.patch_of(requiring().handle(kit.review_of(kit.make_pod({})))) == []
