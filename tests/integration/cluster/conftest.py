"""A real three-node NATS JetStream cluster (three nats-server processes with routes) per test, and R3 bus settings.

`bus_settings` is overridden here, so every fixture built on it (`start_runtime`, `start_agent`)
runs on the cluster in these tests. Kubernetes is the real API server: `dev_cluster`
(tests/support/control_plane.py), with KAI-Scheduler and the GPU node simulated through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import ClusterMember, EmbeddedCluster
from kai_isolator.shared.settings import BusSettings
from kai_isolator.shared.tail import read_stream


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[EmbeddedCluster]:
    cluster = EmbeddedCluster(tmp_path / "cluster")
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def bus_settings(nats_cluster: EmbeddedCluster) -> BusSettings:
    """R3 everywhere; short delays so retry paths run in test time, a publish rides out an election."""
    return BusSettings(
        nats_url=nats_cluster.url, nats_replicas=3, max_deliver=5, backoff_base_s=0.05, backoff_max_s=0.5,
        ack_wait_s=3.0, nats_connect_timeout_s=10.0, publish_retry_s=30.0, jetstream_timeout_s=3.0, nats_ping_interval_s=1.0,
    )


async def stream_leader(cluster: EmbeddedCluster, stream: str = subjects.STREAM_NAME) -> ClusterMember:
    """The member that leads `stream` now (asked of any live member)."""
    live = [m.url for m in cluster.members if m.pid is not None and not m.paused]
    nc = await nats.connect(live, max_reconnect_attempts=3, connect_timeout=2)
    try:
        js = nc.jetstream(timeout=3)
        for _ in range(100):
            try:
                info = await js.stream_info(stream)
            except nats.errors.TimeoutError:
                continue  # a loaded cluster can leave one request unanswered for 3 s (clean-clone CI check); ask again
            if info.cluster is not None and info.cluster.leader:
                return cluster.member(info.cluster.leader)
            await asyncio.sleep(0.1)
        raise AssertionError(f"stream {stream} has no leader")
    finally:
        await nc.close()


async def stream_state(cluster: EmbeddedCluster, stream: str = subjects.STREAM_NAME) -> tuple[int, int, list[str]]:
    """(messages, replicas, names of replicas that are current) of a stream."""
    live = [m.url for m in cluster.members if m.pid is not None and not m.paused]
    nc = await nats.connect(live, max_reconnect_attempts=3, connect_timeout=2)
    try:
        info = await nc.jetstream(timeout=3).stream_info(stream)
        current = [r.name for r in (info.cluster.replicas or []) if r.current] if info.cluster else []
        return info.state.messages, info.config.num_replicas or 1, current
    finally:
        await nc.close()


async def stream_events(url: str, filter_subject: str) -> list[Any]:
    """Every event in the stream under `filter_subject`, in stream order."""
    return [event for _, event in await stream_records(url, filter_subject)]


async def stream_records(url: str, filter_subject: str) -> list[tuple[Any, Any]]:
    """Every (envelope, event) in the stream under `filter_subject`, in stream order (read while the cluster settles)."""
    from kai_isolator.shared.events import decode

    return [decode(m.data) for m in await read_stream(url, filter_subject)]


async def lease_holder(url: str, key: str) -> str | None:
    from kai_isolator.shared.lease import LEASE_BUCKET, LeaseRecord

    nc = await nats.connect(url.split(","))
    try:
        kv = await nc.jetstream(timeout=3).key_value(LEASE_BUCKET)
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return LeaseRecord.model_validate_json(entry.value).holder if entry.value else None
    finally:
        await nc.close()


@pytest.fixture
async def dev_cluster(dev_cluster: DevCluster) -> AsyncIterator[DevCluster]:
    """`dev_cluster` with the simulated KAI's per-GPU booking off: these tests run more 4096 MiB pods on one simulated
    T4 than KAI would place (three), and test something else (tests/integration/devcluster/test_kai_simulation.py
    tests the booking)."""
    assert dev_cluster.scheduler is not None
    dev_cluster.scheduler.options = dataclasses.replace(dev_cluster.scheduler.options, book_capacity=False)
    yield dev_cluster
