"""Streams and KV buckets follow KAI_ISOLATOR_NATS_REPLICAS on a real three-node cluster, and publishing
rides out the stream leader's death and a paused (partitioned) server with nothing lost or stored twice."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import EmbeddedCluster
from kai_isolator.shared.errors import BusError
from kai_isolator.shared.events import AdmissionDecision
from kai_isolator.shared.settings import BusSettings
from support.bus import RuntimeFactory

from .conftest import stream_leader, stream_records, stream_state


def decision(i: int) -> AdmissionDecision:
    return AdmissionDecision(request_uid=f"req-{i}", namespace="default", pod_name=f"pod-{i}", decision="injected", reason="test")


async def kv_replicas(url: str, bucket: str) -> int:
    nc = await nats.connect(url.split(","))
    try:
        return (await nc.jetstream().stream_info(f"KV_{bucket}")).config.num_replicas or 1
    finally:
        await nc.close()


async def test_stream_and_buckets_are_created_with_three_replicas(nats_cluster: EmbeddedCluster, start_runtime: RuntimeFactory) -> None:
    await start_runtime("svc", kv_buckets=["isolator-test-state"])
    _, replicas, current = await stream_state(nats_cluster)
    assert replicas == 3 and sorted(current + [(await stream_leader(nats_cluster)).server_name]) == ["n1", "n2", "n3"]
    assert await kv_replicas(nats_cluster.url, "isolator-test-state") == 3


async def test_existing_single_replica_stream_and_bucket_converge_to_three(nats_cluster: EmbeddedCluster, bus_settings: BusSettings, start_runtime: RuntimeFactory) -> None:
    # As after `helm upgrade` from one NATS server to a cluster: what exists keeps its messages and gains replicas.
    first = await start_runtime("old", settings=bus_settings.model_copy(update={"nats_replicas": 1}), kv_buckets=["isolator-test-state"])
    await first.publish(decision(1))
    await first.kv("isolator-test-state").put("k", b"v")
    assert (await stream_state(nats_cluster))[1] == 1

    second = await start_runtime("new", kv_buckets=["isolator-test-state"])
    messages, replicas, _ = await stream_state(nats_cluster)
    assert (messages, replicas) == (1, 3)
    assert await kv_replicas(nats_cluster.url, "isolator-test-state") == 3
    assert (await second.kv("isolator-test-state").get("k")).value == b"v"


async def test_more_replicas_than_servers_is_a_clear_error(bus_settings: BusSettings, start_runtime: RuntimeFactory) -> None:
    with pytest.raises(BusError, match=r"5 replica.*needs a JetStream cluster of at least 5 servers"):
        await start_runtime("greedy", settings=bus_settings.model_copy(update={"nats_replicas": 5}))


async def published(url: str) -> list[str]:
    """Ids of every AdmissionDecision in the stream, in stream order (asked again while the cluster settles: loaded run
    L24's first consumer create timed out right after the faults)."""
    return [envelope.id for envelope, _ in await stream_records(url, subjects.ALL_ADMISSION)]


async def test_publishing_through_leader_kill_follower_kill_and_a_paused_server_loses_and_repeats_nothing(
        nats_cluster: EmbeddedCluster, start_runtime: RuntimeFactory) -> None:
    runtime = await start_runtime("publisher")
    sent = 0
    stalls: dict[str, float] = {}

    async def publish_for(label: str, count: int) -> None:
        # Every publish waits for the cluster's ack; the longest wait per phase is what a fault cost.
        nonlocal sent
        worst = 0.0
        for _ in range(count):
            started = time.perf_counter()
            await runtime.publish(decision(sent))
            worst = max(worst, time.perf_counter() - started)
            sent += 1
        stalls[label] = worst

    await publish_for("steady", 200)
    leader = await stream_leader(nats_cluster)
    leader.kill()  # SIGKILL the stream leader mid-stream
    await publish_for("leader killed", 200)
    await asyncio.to_thread(leader.start)
    await publish_for("leader back", 100)

    current_leader = await stream_leader(nats_cluster)
    follower = next(m for m in nats_cluster.members if m is not current_leader)
    follower.kill()
    await publish_for("follower killed", 200)
    await asyncio.to_thread(follower.start)

    paused = await stream_leader(nats_cluster)
    paused.pause()  # SIGSTOP: to the others this server is partitioned away
    await publish_for("leader paused", 200)
    paused.resume()
    await publish_for("healed", 100)
    print("worst publish wait per phase (s):", {k: round(v, 3) for k, v in stalls.items()})

    ids = await published(nats_cluster.url)
    assert len(ids) == sent == 1000
    assert ids == [f"admission:req-{i}" for i in range(sent)]
    messages, replicas, _ = await stream_state(nats_cluster)
    assert (messages, replicas) == (1000, 3)
