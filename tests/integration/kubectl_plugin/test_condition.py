"""The verifier's pod condition `kai-resource-isolator.io/Isolated`: written on verdict changes through pods/status,
left alone on a retried verdict, the kubelet's own conditions kept, lastTransitionTime moved only on a flip."""

from __future__ import annotations

from kai_isolator.shared.events import HealthVerdict, PodRef, Reason
from kai_isolator.shared.operator_view import ISOLATED_CONDITION
from support.kubectl_plugin import Cluster


def verdict(pod: dict, kind: str, code: str = "", observation: str = "o") -> HealthVerdict:  # type: ignore[type-arg]
    ref = PodRef(namespace="default", name=pod["metadata"]["name"], uid=pod["metadata"]["uid"])
    return HealthVerdict(pod=ref, node_name="gpu-1", container="main", verdict=kind, observation=observation,  # type: ignore[arg-type]
                         reasons=[Reason(code=code, message="why")] if code else [])


def condition(pod: dict) -> dict:  # type: ignore[type-arg]
    [found] = [c for c in pod["status"]["conditions"] if c["type"] == ISOLATED_CONDITION]
    return found  # type: ignore[no-any-return]


async def test_the_condition_follows_verdicts_and_never_flaps_on_a_retry(cluster: Cluster) -> None:
    pod = await cluster.pod("p")
    assert await cluster.notifier.set_condition(verdict(pod, "missing", "not-injected", "o1"))
    first = await cluster.read_pod("p")
    assert condition(first)["status"] == "False" and condition(first)["reason"] == "not-injected"
    assert condition(first)["message"] == "missing: container main: not-injected: why"
    assert {c["type"] for c in first["status"]["conditions"]} >= {"Ready", "PodScheduled", ISOLATED_CONDITION}

    # The same verdict again (a redelivery, a retry): no write at all.
    assert await cluster.notifier.set_condition(verdict(pod, "missing", "not-injected", "o1"))
    again = await cluster.read_pod("p")
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]

    # Another negative reason: same status, so the transition time stays.
    assert await cluster.notifier.set_condition(verdict(pod, "degraded", "limit-from-env", "o2"))
    degraded = await cluster.read_pod("p")
    assert condition(degraded)["reason"] == "limit-from-env"
    assert condition(degraded)["lastTransitionTime"] == condition(first)["lastTransitionTime"]

    # Verified flips it to True.
    assert await cluster.notifier.set_condition(verdict(pod, "verified", observation="o3"))
    verified = await cluster.read_pod("p")
    assert condition(verified)["status"] == "True" and condition(verified)["reason"] == "verified"
    assert condition(verified)["lastTransitionTime"] >= condition(first)["lastTransitionTime"]
    assert len([c for c in verified["status"]["conditions"] if c["type"] == ISOLATED_CONDITION]) == 1


async def test_a_verdict_about_an_earlier_pod_of_the_same_name_is_not_written(cluster: Cluster) -> None:
    old = await cluster.pod("same")
    await cluster.core.delete_namespaced_pod("same", "default", grace_period_seconds=0)
    await cluster.pod("same")
    assert not await cluster.notifier.set_condition(verdict(old, "missing", "not-injected"))
    assert not [c for c in (await cluster.read_pod("same"))["status"]["conditions"] if c["type"] == ISOLATED_CONDITION]
