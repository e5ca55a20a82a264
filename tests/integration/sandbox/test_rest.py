"""The sandbox API through kubernetes-asyncio, unchanged: CRUD, Status errors, list/watch, bookmarks, 410, selectors."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from kai_isolator.services.sandbox.api import SandboxApi

from .conftest import pod_body


async def test_crud_and_status_errors(core: CoreV1Api) -> None:
    created = await core.create_namespaced_pod("default", pod_body("web", labels={"app": "web"}))
    assert created.metadata.uid and created.status.phase == "Pending"
    with pytest.raises(ApiException) as caught:
        await core.create_namespaced_pod("default", pod_body("web"))
    assert caught.value.status == 409 and "already exists" in caught.value.body
    with pytest.raises(ApiException) as caught:
        await core.read_namespaced_pod("absent", "default")
    assert caught.value.status == 404 and '"reason":"NotFound"' in caught.value.body
    with pytest.raises(ApiException) as caught:
        await core.create_namespaced_pod("default", {"metadata": {"name": "Bad_Name"}, "spec": {"containers": [{"name": "c", "image": "i"}]}})
    assert caught.value.status == 422

    patched = await core.patch_namespaced_pod("web", "default", {"metadata": {"annotations": {"note": "hi"}}})
    assert patched.metadata.annotations == {"note": "hi"} and int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    stale = {"metadata": {"resourceVersion": created.metadata.resource_version, "labels": {"app": "other"}}}
    with pytest.raises(ApiException) as caught:
        await core.patch_namespaced_pod("web", "default", stale)
    assert caught.value.status == 409
    json_patched = await core.patch_namespaced_pod("web", "default", [{"op": "add", "path": "/metadata/labels/tier", "value": "front"}])
    assert json_patched.metadata.labels == {"app": "web", "tier": "front"}
    with pytest.raises(ApiException) as caught:
        await core.patch_namespaced_pod("web", "default", [{"op": "replace", "path": "/spec/containers/0/image", "value": "evil"}])
    assert caught.value.status == 422

    await core.delete_namespaced_pod("web", "default")
    with pytest.raises(ApiException):
        await core.read_namespaced_pod("web", "default")


async def test_selectors_on_list(sandbox: SandboxApi, core: CoreV1Api) -> None:
    await sandbox.create("pods", {**pod_body("a", labels={"app": "x"}), "spec": {"nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"}, "containers": [{"name": "c", "image": "i"}]}}, "default")
    await sandbox.create("pods", pod_body("b", labels={"app": "y"}), "default")
    assert [p.metadata.name for p in (await core.list_namespaced_pod("default", label_selector="app in (x,y),app!=y")).items] == ["a"]
    from support import eventually
    await eventually(lambda: sandbox.get("pods", "default", "a")["status"]["phase"] == "Running")
    on_node = await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=gpu-node-1,status.phase=Running")
    assert [p.metadata.name for p in on_node.items] == ["a"]
    with pytest.raises(ApiException) as caught:
        await core.list_namespaced_pod("default", field_selector="spec.hostname=x")
    assert caught.value.status == 400


async def test_watch_from_version_streams_later_changes_in_order_with_bookmarks(sandbox: SandboxApi, core: CoreV1Api) -> None:
    listed = await core.list_namespaced_config_map("default")
    version = listed.metadata.resource_version
    for name in ("one", "two"):
        await core.create_namespaced_config_map("default", {"metadata": {"name": name}})
    await core.delete_namespaced_config_map("one", "default")
    seen: list[tuple[str, str]] = []
    bookmarks = 0
    async with watch.Watch() as stream:
        async for event in stream.stream(core.list_namespaced_config_map, "default", resource_version=version, allow_watch_bookmarks=True, timeout_seconds=5):
            if event["type"] == "BOOKMARK":
                bookmarks += 1
                if bookmarks == 2:
                    break
                continue
            seen.append((event["type"], event["object"].metadata.name))
    assert seen == [("ADDED", "one"), ("ADDED", "two"), ("DELETED", "one")]
    assert int(stream.resource_version) == sandbox.store.rv


async def test_expired_version_is_410_gone(sandbox: SandboxApi, core: CoreV1Api) -> None:
    version = (await core.list_namespaced_config_map("default")).metadata.resource_version
    for i in range(60):  # more than the retained window of 50
        await core.create_namespaced_config_map("default", {"metadata": {"name": f"cm-{i}"}})
    with pytest.raises(ApiException) as caught:
        async with watch.Watch() as stream:
            async for _ in stream.stream(core.list_namespaced_config_map, "default", resource_version=version, timeout_seconds=5):
                pass
    assert caught.value.status == 410


async def test_watch_ends_at_timeout_seconds_and_client_read_timeout_detects_silence(sandbox: SandboxApi, core: CoreV1Api) -> None:
    version = (await core.list_namespaced_pod("default")).metadata.resource_version
    async with watch.Watch() as stream:
        events = [e async for e in stream.stream(core.list_namespaced_pod, "default", resource_version=version, timeout_seconds=1)]
    assert events == []
    with pytest.raises(asyncio.TimeoutError):
        async with watch.Watch() as stream:
            async for _ in stream.stream(core.list_namespaced_pod, "default", resource_version=version, timeout_seconds=30, _request_timeout=aiohttp.ClientTimeout(sock_read=0.3)):
                pass


async def test_discovery_documents(sandbox: SandboxApi) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{sandbox.url}/api/v1") as reply:
            names = {r["name"] for r in (await reply.json())["resources"]}
        async with http.get(f"{sandbox.url}/apis") as reply:
            groups = {g["name"] for g in (await reply.json())["groups"]}
        async with http.get(f"{sandbox.url}/api/v1/nosuch") as reply:
            status = await reply.json()
    assert {"pods", "namespaces", "nodes", "configmaps", "events", "pods/status", "pods/binding"} <= names
    assert groups == {"admissionregistration.k8s.io"}
    assert status["kind"] == "Status" and status["code"] == 404
