"""Sandbox API pieces in isolation: selectors, patches, match conditions, store versions and KAI's limit arithmetic."""

from __future__ import annotations

import pytest

from kai_isolator.services.sandbox.conditions import Condition, ConditionError
from kai_isolator.services.sandbox.nodesim import kai_memory_limit, scheduler_portion
from kai_isolator.services.sandbox.patching import apply_patch
from kai_isolator.services.sandbox.selectors import fields_match, labels_match, parse_field_selector, parse_label_selector
from kai_isolator.services.sandbox.status import ApiError
from kai_isolator.services.sandbox.store import Store


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ("app=web", {"app": "web"}, True),
    ("app==web,tier!=db", {"app": "web", "tier": "db"}, False),
    ("env in (prod, staging)", {"env": "staging"}, True),
    ("env notin (prod)", {}, True),
    ("gpu", {"gpu": ""}, True),
    ("!gpu", {"gpu": "x"}, False),
    ("", {}, True),
])
def test_label_selectors(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert labels_match(parse_label_selector(selector), labels) is expected


def test_bad_selectors_are_400() -> None:
    with pytest.raises(ApiError) as caught:
        parse_label_selector("a=b=c")
    assert caught.value.code == 400
    with pytest.raises(ApiError, match="field label not supported: spec.hostname"):
        parse_field_selector("spec.hostname=x", "pods")


def test_field_selectors_on_pods() -> None:
    pod = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}
    assert fields_match(parse_field_selector("spec.nodeName=n1,status.phase!=Failed", "pods"), pod)
    assert not fields_match(parse_field_selector("metadata.namespace=other", "pods"), pod)


def test_patch_kinds() -> None:
    doc = {"metadata": {"name": "p", "labels": {"a": "1", "b": "2"}}}
    merged = apply_patch(doc, "application/merge-patch+json", {"metadata": {"labels": {"a": None, "c": "3"}}})
    assert merged["metadata"]["labels"] == {"b": "2", "c": "3"}
    strategic = apply_patch(doc, "application/strategic-merge-patch+json", {"metadata": {"annotations": {"x": "y"}}})
    assert strategic["metadata"]["annotations"] == {"x": "y"} and strategic["metadata"]["labels"] == doc["metadata"]["labels"]
    ops = [{"op": "add", "path": "/metadata/labels/k8s.io~1x", "value": "v"}, {"op": "remove", "path": "/metadata/labels/a"}, {"op": "test", "path": "/metadata/name", "value": "p"}]
    patched = apply_patch(doc, "application/json-patch+json", ops)
    assert patched["metadata"]["labels"] == {"b": "2", "k8s.io/x": "v"}
    assert doc["metadata"]["labels"] == {"a": "1", "b": "2"}  # the original is untouched


@pytest.mark.parametrize(("content_type", "patch", "code"), [
    ("application/json-patch+json", [{"op": "remove", "path": "/spec/missing"}], 422),
    ("application/json-patch+json", [{"op": "test", "path": "/metadata/name", "value": "q"}], 422),
    ("application/json-patch+json", {"op": "add"}, 400),
    ("application/apply-patch+yaml", {}, 415),
    ("application/strategic-merge-patch+json", {"spec": {"$patch": "replace"}}, 422),
])
def test_bad_patches_are_refused_whole(content_type: str, patch: object, code: int) -> None:
    with pytest.raises(ApiError) as caught:
        apply_patch({"metadata": {"name": "p"}}, content_type, patch)
    assert caught.value.code == code


def test_match_conditions_subset() -> None:
    pod = {"metadata": {"annotations": {"gpu-memory": "4096"}, "labels": {"team": "a"}}}
    assert Condition("has(object.metadata.annotations) && ('gpu-fraction' in object.metadata.annotations || 'gpu-memory' in object.metadata.annotations)").evaluate(pod)
    assert Condition("object.metadata.labels['team'] == 'a' && !(object.metadata.labels['team'] != 'a')").evaluate(pod)
    assert not Condition("has(object.metadata.finalizers)").evaluate(pod)
    with pytest.raises(ConditionError):
        Condition("object.spec.containers.size() > 0")
    with pytest.raises(ConditionError):
        Condition("'x' in object.metadata.finalizers").evaluate(pod)


@pytest.mark.parametrize(("annotations", "label", "portion", "limit"), [
    ({"gpu-memory": "4096"}, 15360, "0.27", "4147m"),  # the docs' T4 example
    ({"gpu-memory": "4096"}, 16384, "0.26", "4259m"),
    ({"gpu-memory": "2000"}, 11264, "0.18", "2027m"),
    ({"gpu-fraction": "0.5"}, 81559, "0.50", "40779m"),
    ({"gpu-memory": "7680"}, 15360, "0.51", "7833m"),
    ({"gpu-fraction": "0.001"}, 15360, "0.00", None),  # KAI writes no limit: the pod runs uncapped
    ({"gpu-memory": "4096"}, 0, None, None),
])
def test_kai_limit_arithmetic(annotations: dict[str, str], label: int, portion: str | None, limit: str | None) -> None:
    assert scheduler_portion(annotations, label) == portion
    assert kai_memory_limit(annotations, label) == limit


def test_store_versions_conflicts_and_expiry() -> None:
    store = Store(retained_events=3)
    pod = store.create("pods", {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}, "default")
    first = int(pod["metadata"]["resourceVersion"])
    stale = {**pod, "metadata": {**pod["metadata"], "labels": {"a": "b"}}}
    store.update("pods", "default", "p", stale)
    with pytest.raises(ApiError) as caught:
        store.update("pods", "default", "p", {**stale, "metadata": {**stale["metadata"], "labels": {"a": "c"}}})
    assert caught.value.code == 409
    with pytest.raises(ApiError) as caught:
        store.create("pods", {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}, "default")
    assert (caught.value.code, caught.value.reason) == (409, "AlreadyExists")
    with pytest.raises(ApiError) as caught:
        store.create("pods", {"metadata": {"name": "q"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}, "nowhere")
    assert caught.value.code == 404
    for value in ("x", "y", "z"):
        store.create("configmaps", {"metadata": {"name": value}}, "default")
    with pytest.raises(ApiError) as caught:
        store.watch("pods", None, None, None, str(first))
    assert caught.value.code == 410
    replay = store.watch("configmaps", None, None, None, str(store.rv - 2))
    assert [obj["metadata"]["name"] for _, obj in [replay.queue.get_nowait() for _ in range(replay.queue.qsize())]] == ["y", "z"]


def test_selector_watch_sees_objects_leave_and_enter() -> None:
    store = Store()
    store.create("configmaps", {"metadata": {"name": "c", "labels": {"app": "x"}}}, "default")
    stream = store.watch("configmaps", "default", "app=x", None, str(store.rv))
    cm = store.get("configmaps", "default", "c")
    store.update("configmaps", "default", "c", {**cm, "metadata": {**cm["metadata"], "labels": {"app": "y"}}})
    cm = store.get("configmaps", "default", "c")
    store.update("configmaps", "default", "c", {**cm, "metadata": {**cm["metadata"], "labels": {"app": "x"}}})
    assert [stream.queue.get_nowait()[0] for _ in range(2)] == ["DELETED", "ADDED"]
