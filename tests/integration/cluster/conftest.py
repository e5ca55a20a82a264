"""A real three-node NATS JetStream cluster (three nats-server processes with routes) per test, and R3 bus settings.

`bus_settings` is overridden here, so every fixture built on it (`start_runtime`, `start_agent`)
runs on the cluster in these tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import ClusterMember, EmbeddedCluster
from kai_isolator.shared.settings import BusSettings


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
            info = await js.stream_info(stream)
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
