"""Two watcher processes (active/standby on a KV lease) on a three-node R3 cluster under steady pod churn:
the leader SIGKILLed, the next one SIGSTOPped past its lease (then resumed: it must be fenced), the
stream leader SIGKILLed and a NATS server paused. Every pod's story ends up on the stream complete,
in order, each fact once. Pods live on the real kube-apiserver (`dev_cluster`): KAI's admission, binder and
the node's kubelet are simulated through its API, and the watchers list/watch it as in a cluster."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from kai_isolator.services.devcluster.cluster import ApiCallError, DevCluster
from kai_isolator.shared import subjects
from kai_isolator.shared.embedded_nats import EmbeddedCluster
from kai_isolator.shared.events import PodIsolation
from support.pods import T4, gpu_pod
from support.processes import ServiceProcess, start_service
from support.waiting import eventually

from .conftest import lease_holder, stream_events, stream_leader

FULL_STORY = ["admitted", "isolation-missing", "scheduled", "running"]
LEASE_KEY = "watcher.all"
TTL_S = 2.0
# Active/standby on a short lease, resume points saved often, quick retries on the R3 cluster.
WATCHER_ENV = {"KAI_ISOLATOR_NATS_REPLICAS": "3", "KAI_ISOLATOR_NATS_PING_INTERVAL_S": "1", "KAI_ISOLATOR_BACKOFF_BASE_S": "0.05",
               "KAI_ISOLATOR_WATCHER_LEASE_TTL_S": str(TTL_S), "KAI_ISOLATOR_WATCHER_RESUME_SAVE_INTERVAL_S": "0.2",
               "KAI_ISOLATOR_WATCHER_BACKOFF_MAX_S": "0.5", "KAI_ISOLATOR_LOG_LEVEL": "info"}


async def leader_of(url: str, watchers: list[ServiceProcess]) -> ServiceProcess:
    for _ in range(200):
        holder = await lease_holder(url, LEASE_KEY)
        for w in watchers:
            if holder and f":{w.pid}:" in holder:
                return w
        await asyncio.sleep(0.1)
    raise AssertionError("no watcher holds the lease")


@pytest.mark.timeout(400)
async def test_two_watchers_through_watcher_and_nats_faults_lose_and_repeat_nothing(nats_cluster: EmbeddedCluster, dev_cluster: DevCluster,
                                                                                   tmp_path: Path) -> None:
    args, env = ["watcher", "--kubeconfig", str(dev_cluster.kubeconfig)], {"KAI_ISOLATOR_NATS_URL": nats_cluster.url, **WATCHER_ENV}
    url = nats_cluster.url
    # Each watcher's log in the test's own dir (the kubeconfig's is the session's); started once its /healthz answers.
    watchers = [await start_service(args, env, tmp_path, ready="/healthz") for _ in range(2)]
    created: list[str] = []
    deleted: list[str] = []
    stop_churn = asyncio.Event()

    async def churn() -> None:
        # Steady: a pod every 50 ms (each create also waits on KAI's webhook); every seventh earlier pod
        # that is Running gets deleted (gracefully: the kubelet confirms it, then the API server removes it).
        i = 0
        while not stop_churn.is_set():
            name = f"p-{i}"
            await dev_cluster.create("pods", gpu_pod(name, node=T4), "default")
            created.append(name)
            if i % 7 == 6:
                victim = created[i - 5]
                if await phase(victim) == "Running":
                    await dev_cluster.delete("pods", "default", victim)
                    deleted.append(victim)
            i += 1
            await asyncio.sleep(0.05)

    async def phase(name: str) -> str | None:
        try:
            return (await dev_cluster.get("pods", "default", name)).get("status", {}).get("phase")
        except ApiCallError as error:
            if error.code == 404:
                return None
            raise

    async def stories() -> dict[str, list[str]]:
        events = [e for e in await stream_events(url, subjects.ALL_PODS) if isinstance(e, PodIsolation)]
        by_pod: dict[str, list[str]] = {}
        for e in events:
            by_pod.setdefault(e.pod.name, []).append(e.state)
        return by_pod

    def complete(by_pod: dict[str, list[str]]) -> bool:
        return all(by_pod.get(n, [])[:4] == FULL_STORY for n in created) and all("deleted" in by_pod.get(n, []) for n in deleted)

    churner = asyncio.create_task(churn())
    try:
        await asyncio.sleep(2)
        first = await leader_of(url, watchers)
        first.process.kill()  # SIGKILL the active watcher mid-stream
        await first.process.wait()
        watchers.remove(first)
        watchers.append(await start_service(args, env, tmp_path, ready="/healthz"))  # as its Deployment would replace it
        await asyncio.sleep(2 * TTL_S)

        second = await leader_of(url, watchers)
        os.kill(second.pid, signal.SIGSTOP)  # paused past its lease: the standby must take over
        await asyncio.sleep(3 * TTL_S)
        third = await leader_of(url, [w for w in watchers if w is not second])
        os.kill(second.pid, signal.SIGCONT)  # it wakes up believing it leads: its writes must be refused
        await eventually(lambda: second.metric("kai_isolator_watcher_step_downs_total") >= 1, timeout_s=30)
        assert second.metric("kai_isolator_watcher_leader") == 0 and third.metric("kai_isolator_watcher_leader") == 1

        nats_leader = await stream_leader(nats_cluster)
        nats_leader.kill()  # SIGKILL the stream's leader under the churn
        await asyncio.sleep(3)
        await asyncio.to_thread(nats_leader.start)
        paused = next(m for m in nats_cluster.members if m is not nats_leader)
        paused.pause()  # one server partitioned away (SIGSTOP)
        await asyncio.sleep(4)
        paused.resume()
        await asyncio.sleep(2)
    finally:
        stop_churn.set()
        await churner

    try:
        by_pod: dict[str, list[str]] = {}

        async def settled() -> bool:
            nonlocal by_pod
            by_pod = await stories()
            return complete(by_pod)

        for _ in range(60):
            if await settled():
                break
            await asyncio.sleep(1)
        missing = [n for n in created if by_pod.get(n, [])[:4] != FULL_STORY]
        if missing:
            for name in missing:
                print(name, "story on the bus:", by_pod.get(name), "phase in the API:", await phase(name))
            for w in watchers:
                print(w.pid, [line for line in w.get("/metrics")[1].splitlines() if line.startswith("kai_isolator_watcher") or "published" in line])
        assert missing == [] and [n for n in deleted if "deleted" not in by_pod.get(n, [])] == []
        for name in created:
            assert by_pod[name] == FULL_STORY + (["deleted"] if name in deleted else []), name
        events = [e for e in await stream_events(url, subjects.ALL_PODS) if isinstance(e, PodIsolation)]
        assert [k for k, n in Counter((e.pod.uid, e.state) for e in events).items() if n > 1] == []
        print(f"{len(created)} pods, {len(deleted)} deleted, {len(events)} events, each once")
        for w in watchers:
            assert w.process.returncode is None  # none crashed
            assert w.get("/readyz")[0] == 200
    finally:
        for w in watchers:
            if w.process.returncode is None:
                w.process.send_signal(signal.SIGTERM)
                await w.process.wait()
