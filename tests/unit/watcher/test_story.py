"""What counts as injected: the webhook's shape, not a tenant's look-alike; node scopes that cannot collide."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from kai_isolator.services.admission.injection import InjectionConfig, desired_for
from kai_isolator.services.admission.mutation import patch_ops
from kai_isolator.services.admission.pod import find_target, read_pod
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.services.watcher.story import view_of
from support.pods import gpu_pod


def injected_by_the_webhook(pod: dict[str, Any]) -> dict[str, Any]:
    config = InjectionConfig()
    view = read_pod(pod)
    target = find_target(view)
    return jsonpatch.apply_patch(pod, patch_ops(view, target, config, desired_for(target, config)))


def test_the_webhooks_patch_counts_as_injected() -> None:
    view = view_of(injected_by_the_webhook(gpu_pod("train", uid="u1", resource_version="3", scheduler=None)))
    assert view is not None and view.injected


@pytest.mark.parametrize("forge", ["emptydir", "writable", "no-subpath", "directory-or-create"])
def test_a_tenants_look_alike_volume_is_not_injection(forge: str) -> None:
    pod = copy.deepcopy(injected_by_the_webhook(gpu_pod("train", uid="u1", resource_version="3", scheduler=None)))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "kai-resource-isolator-vgpu")
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/etc/ld.so.preload")
    if forge == "emptydir":
        volume.pop("hostPath")
        volume["emptyDir"] = {}
    elif forge == "writable":
        mount["readOnly"] = False
    elif forge == "no-subpath":
        mount.pop("subPath")
    else:
        volume["hostPath"]["type"] = "DirectoryOrCreate"
    view = view_of(pod)
    assert view is not None and not view.injected


def test_node_scopes_do_not_prefix_each_other() -> None:
    assert WatcherSettings(node="gpu").scope == "node.gpu"
    assert WatcherSettings(node="gpu.a").scope == "node.gpu_a"  # KV keys under node.gpu.> never include gpu.a's
