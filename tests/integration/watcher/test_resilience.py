"""Restarts of the watcher and of the API server, a real compaction's 410 Gone, and NATS outages: every change
reaches a durable consumer exactly once."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections import Counter

import nats
import nats.js.errors
import pytest

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.events import decode
from kai_isolator.shared.settings import BusSettings
from support.pods import T4, gpu_pod
from support.waiting import eventually

from .conftest import PodEvents, delete_for_good, phase, wait_phase

FULL_STORY = ["admitted", "isolation-missing", "scheduled", "running"]


async def last_stored_state(bus: BusSettings, name: str, namespace: str = "default") -> str | None:
    """The state of the last event the stream holds for the pod: tells a lost publish from a lost delivery."""
    nc = await nats.connect(bus.nats_url or "", connect_timeout=2, max_reconnect_attempts=0)
    try:
        last = await nc.jetstream().get_last_msg(subjects.STREAM_NAME, subjects.pod(namespace, name))
    except nats.js.errors.NotFoundError:
        return None
    finally:
        await nc.close()
    _, event = decode(last.data)
    return getattr(event, "state", None)


def assert_exactly_once(events: PodEvents) -> None:
    seen = Counter((e.pod.uid, e.state) for e in events.received)
    assert [key for key, n in seen.items() if n > 1] == []


async def test_killed_mid_stream_and_restarted_loses_and_repeats_nothing(dev_cluster: DevCluster, bus_settings: BusSettings, watcher_settings: WatcherSettings,
                                                                         start_watcher, pod_events: PodEvents) -> None:
    env = {**os.environ, "KAI_ISOLATOR_NATS_URL": bus_settings.nats_url or "", "KAI_ISOLATOR_WATCHER_RESUME_SAVE_INTERVAL_S": "0.2", "KAI_ISOLATOR_WATCHER_LEASE_TTL_S": "2", "KAI_ISOLATOR_LOG_LEVEL": "warning"}
    first = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kai_isolator.services.cli", "watcher", "--kubeconfig", str(watcher_settings.kubeconfig), "--probe-listen", "127.0.0.1:0", env=env,
    )
    try:
        await dev_cluster.create("pods", gpu_pod("job-0", node=T4), "default")
        await eventually(lambda: pod_events.count() >= 2, timeout_s=60)  # the process is up and watching
        for i in range(1, 40):
            await dev_cluster.create("pods", gpu_pod(f"job-{i}", node=T4), "default")
        await eventually(lambda: pod_events.count() >= 30)
    finally:
        first.kill()  # SIGKILL mid-stream: no graceful stop, no final save
        await first.wait()

    for i in range(40, 50):
        await dev_cluster.create("pods", gpu_pod(f"job-{i}", node=T4), "default")
    await wait_phase(dev_cluster, "job-0", "Running")
    await delete_for_good(dev_cluster, "job-0")  # while no watcher runs: only the resumed watch can tell of it
    await start_watcher()
    await dev_cluster.create("pods", gpu_pod("job-50", node=T4), "default")

    names = [f"job-{i}" for i in range(51)]

    def complete() -> bool:
        return all(pod_events.states(n)[:4] == FULL_STORY for n in names) and "deleted" in pod_events.states("job-0")
    try:
        # A liveness bound, not a speed goal: a loaded 2-core CI machine once needed more than 30 s here.
        await eventually(complete, timeout_s=60)
    except AssertionError:
        short = {n: pod_events.states(n) for n in names if pod_events.states(n)[:4] != FULL_STORY}
        facts = {n: (await phase(dev_cluster, n), await last_stored_state(bus_settings, n)) for n in short}
        raise AssertionError(f"stories incomplete after the restart: {short}; (phase, last state in the stream): {facts}; "
                             f"job-0: {pod_events.states('job-0')}") from None
    assert_exactly_once(pod_events)
    assert pod_events.states("job-0") == [*FULL_STORY, "deleted"]
    assert all(pod_events.states(n) == FULL_STORY for n in names[1:])


async def test_410_gone_relists_and_reconciles_missed_changes(dev_cluster: DevCluster, start_watcher, pod_events: PodEvents) -> None:
    _, stack = await start_watcher()
    for name in ("keep", "doomed", "finishing"):
        await dev_cluster.create("pods", gpu_pod(name, node=T4), "default")
    await eventually(lambda: all(pod_events.states(n) == FULL_STORY for n in ("keep", "doomed", "finishing")))
    await stack.aclose()  # graceful: the resume version is saved

    # Every missed change done for good before the history goes, so only the relist can tell of them.
    await delete_for_good(dev_cluster, "doomed")
    await dev_cluster.finish("default", "finishing", 1)
    await dev_cluster.create("pods", gpu_pod("newcomer", scheduler=None), "default")
    compacted = await dev_cluster.compact()  # etcd forgets every version before now, the saved resume version included
    # kube-apiserver's watch cache still serves the compacted range (a watch from the saved version would be
    # answered from it, no 410); a restarted API server's cache begins after the compaction, as one whose cache
    # window has moved past the version does. Then the saved version is gone from both.
    await dev_cluster.restart_apiserver()

    watcher, _ = await start_watcher()
    await eventually(lambda: "deleted" in pod_events.states("doomed") and "finished" in pod_events.states("finishing") and len(pod_events.states("newcomer")) == 2)
    assert compacted > 0
    assert watcher.metrics.relists._value.get() == 1  # it resumed, met 410 Gone, and relisted once
    assert pod_events.states("doomed") == [*FULL_STORY, "deleted"]
    assert pod_events.states("finishing") == [*FULL_STORY, "finished"]
    assert pod_events.states("newcomer") == ["admitted", "isolation-missing"]
    assert pod_events.states("keep") == FULL_STORY
    assert_exactly_once(pod_events)


async def test_api_server_restart_mid_stream_loses_and_repeats_nothing(dev_cluster: DevCluster, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    for name in ("before", "doomed"):
        await dev_cluster.create("pods", gpu_pod(name, node=T4), "default")
    await eventually(lambda: pod_events.states("before") == FULL_STORY and pod_events.states("doomed") == FULL_STORY)

    # Every watch on it ends, the watcher's included; KAI's scheduler and the kubelets ride it out too. The new
    # server's watch cache begins at its start, so the watcher's resume version meets 410 Gone even with no
    # compaction and it relists: the story still has to come out whole, each fact once.
    await dev_cluster.restart_apiserver()
    await dev_cluster.create("pods", gpu_pod("after", node=T4), "default")
    await dev_cluster.delete("pods", "default", "doomed")
    await dev_cluster.finish("default", "before", 0)

    await eventually(lambda: pod_events.states("after") == FULL_STORY and "deleted" in pod_events.states("doomed")
                     and "finished" in pod_events.states("before"), timeout_s=30)
    assert pod_events.states("doomed") == [*FULL_STORY, "deleted"]
    assert pod_events.states("before") == [*FULL_STORY, "finished"]
    assert_exactly_once(pod_events)


async def test_nats_outage_during_churn_loses_nothing(dev_cluster: DevCluster, nats_server: EmbeddedNats, start_watcher, pod_events: PodEvents) -> None:
    await start_watcher()
    await dev_cluster.create("pods", gpu_pod("before", node=T4), "default")
    await eventually(lambda: pod_events.states("before") == FULL_STORY)

    await asyncio.to_thread(nats_server.stop)
    for i in range(15):
        await dev_cluster.create("pods", gpu_pod(f"during-{i}", node=T4), "default")

    async def all_running() -> bool:
        return all([await phase(dev_cluster, f"during-{i}") == "Running" for i in range(15)])

    await eventually(all_running)
    await dev_cluster.delete("pods", "default", "before")
    await dev_cluster.delete("pods", "default", "during-0")
    await asyncio.to_thread(nats_server.start)

    await eventually(lambda: all(pod_events.states(f"during-{i}")[:4] == FULL_STORY for i in range(15)) and "deleted" in pod_events.states("during-0") and "deleted" in pod_events.states("before"), timeout_s=40)
    assert pod_events.states("during-0") == [*FULL_STORY, "deleted"]
    assert pod_events.states("before") == [*FULL_STORY, "deleted"]
    assert_exactly_once(pod_events)


async def test_a_nats_outage_past_the_lease_term_keeps_the_lone_watcher_leading(
        dev_cluster: DevCluster, nats_server: EmbeddedNats, start_watcher, pod_events: PodEvents, caplog: pytest.LogCaptureFixture) -> None:
    # The shipped lease (10 s, a term of 8 s) and an outage past its term whenever the last renewal was: the one
    # watcher stops acting, then renews the lease nobody took over instead of stepping down and taking it back.
    watcher, _ = await start_watcher(lease_ttl_s=WatcherSettings.model_fields["lease_ttl_s"].default)
    await dev_cluster.create("pods", gpu_pod("before", node=T4), "default")
    await eventually(lambda: pod_events.states("before") == FULL_STORY)
    with caplog.at_level(logging.INFO, logger="kai_isolator.shared.lease"):
        await asyncio.to_thread(nats_server.stop)
        await dev_cluster.create("pods", gpu_pod("during", node=T4), "default")
        await asyncio.sleep(watcher.settings.lease_ttl_s * 0.8 + 1)
        assert not watcher.lease.held()  # past its term it does nothing a rival might be doing
        await asyncio.to_thread(nats_server.start)
        await eventually(lambda: pod_events.states("during") == FULL_STORY, timeout_s=30)
    assert watcher.metrics.step_downs._value.get() == 0 and watcher.metrics.leader._value.get() == 1 and watcher.lease.held()
    said = [r.getMessage() for r in caplog.records]
    assert any("lease term ran out" in m for m in said) and not any("standing by" in m for m in said), said
    assert pod_events.states("before") == FULL_STORY
    assert_exactly_once(pod_events)
