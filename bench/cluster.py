"""A three-node R3 JetStream cluster against one server, in the same run: publish latency, events/s, pod change -> event, and the stall each fault causes.

Steady state (interleaved rounds, medians): the runtime's publish awaited one at a time (p50/p99 of
the wait for the cluster's ack), the same with a consumer (publish -> typed handler, p50/p99), and
events/s with 256 publishes in flight; each figure for one server (R1) and the cluster (R3) and the
ratio. Faults, on the cluster under sequential publishing: the stream leader SIGKILLed, a follower
SIGKILLed, the leader SIGSTOPped (a partition, as the others see it), each with the client connected
to the victim and to the others. For each: the longest single publish wait, and how many events were
stored and duplicated (none should be missing or twice). The client uses the services' defaults
(ping interval, publish retry) unless told otherwise.
The same faults under the watcher's pipelined publishing (its AckPipeline, `--lanes` publishes in flight,
each retried as the watcher retries), with what awaits its ack sent again on a lost connection, and
without (the baseline: each waits out the ack timeout), interleaved per fault.
A server kept down (`--down-s`, 60 s: a NATS pod lost with its node): the stream's leader, a KV bucket's
leader, then the server the client is connected to, each SIGKILLed and kept down while one client
publishes one event at a time, writes and reads a KV key and handles the events on a durable consumer.
For each: the longest publish, KV operation and publish -> handler wait while the server was down, the
client's failover (its server killed -> connected to another), and what reached the stream; each
figure beside a no-fault run of the same loop in the same run, and their ratio.
Run: .venv/bin/python bench/cluster.py [--events N] [--rounds R] [--fault-s S] [--down-s D] [--ping-interval-s P]
     [--jetstream-timeout-s T] [--lanes L] [--only steady,sequential,pipelined,down]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
from nats.aio.msg import Msg

from kai_isolator.services.watcher.acks import AckPipeline
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared import subjects
from kai_isolator.shared.bus import HEADERS_CONTENT_TYPE, Runtime
from kai_isolator.shared.embedded_nats import ClusterMember, EmbeddedCluster, EmbeddedNats
from kai_isolator.shared.events import PodIsolation, PodRef, decode, encode
from kai_isolator.shared.settings import BusSettings
from kai_isolator.shared.tail import read_stream

IN_FLIGHT = 256
DOWN_BUCKET = "bench_down"
DOWN_FAULTS = ("stream leader", "bucket leader", "client's server")
BASELINE_S = 10.0
_ids = itertools.count()  # one sequence for the whole run: the duplicate window must swallow no publish


def event() -> PodIsolation:
    i = next(_ids)
    return PodIsolation(
        pod=PodRef(namespace="bench", name=f"pod-{i}", uid=f"uid-{i}"), resource_version=str(i), state="running",
        node_name="gpu-node-1", container="main", injected=True, gpu_memory="4096", expected_limit="4147m",
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


@dataclass
class Steady:
    publish_ms: list[float] = field(default_factory=list)
    delivery_ms: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)


async def sequential_publish(url: str, settings: BusSettings, count: int, consumer_name: str) -> tuple[list[float], list[float]]:
    """(publish waits, publish -> handler latencies) in ms, one publish at a time, a consumer running beside it."""
    sent_at: dict[str, float] = {}
    delivered: list[float] = []
    done = asyncio.Event()

    async def handler(pod: PodIsolation) -> None:
        started = sent_at.get(pod.resource_version)
        if started is not None:
            delivered.append((time.perf_counter() - started) * 1000)
        if len(delivered) == count:
            done.set()

    consumer = Runtime(consumer_name, settings)
    consumer.on_event("latency", subjects.ALL_PODS, handler, new_only=True)
    await consumer.start(url)
    publisher = Runtime("bench-publisher", settings)
    await publisher.start(url)
    waits = []
    for _ in range(count):
        pod = event()
        started = sent_at[pod.resource_version] = time.perf_counter()
        await publisher.publish(pod)
        waits.append((time.perf_counter() - started) * 1000)
    await asyncio.wait_for(done.wait(), 60)
    await publisher.stop()
    await consumer.stop()
    return waits, delivered


async def windowed_publish(url: str, settings: BusSettings, count: int) -> float:
    publisher = Runtime("bench-publisher", settings)
    await publisher.start(url)
    events = [event() for _ in range(count)]
    started = time.perf_counter()
    for start in range(0, count, IN_FLIGHT):
        await asyncio.gather(*(publisher.publish(e) for e in events[start:start + IN_FLIGHT]))
    rate = count / (time.perf_counter() - started)
    await publisher.stop()
    return rate


async def steady_round(url: str, settings: BusSettings, count: int, into: Steady, tag: str) -> None:
    waits, delivered = await sequential_publish(url, settings, count, f"bench-{tag}")
    into.publish_ms += waits
    into.delivery_ms += delivered
    into.rate.append(await windowed_publish(url, settings, count * 4))


async def stream_leader(cluster: EmbeddedCluster) -> ClusterMember:
    live = [m.url for m in cluster.members if m.pid is not None and not m.paused]
    nc = await nats.connect(live, connect_timeout=2)
    try:
        js = nc.jetstream(timeout=3)
        while True:
            info = await js.stream_info(subjects.STREAM_NAME)
            if info.cluster is not None and info.cluster.leader:
                return cluster.member(info.cluster.leader)
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def stored_ids(url: str) -> list[str]:
    """resource_versions of every pod event in the stream."""
    return [decode(m.data)[1].resource_version for m in await read_stream(url, subjects.ALL_PODS)]  # type: ignore[attr-defined]


async def fault(cluster: EmbeddedCluster, settings: BusSettings, name: str, client_on_victim: bool, fault_s: float) -> dict[str, object]:
    """Publish one at a time through fault `name`; the worst wait and what reached the stream.

    The client is connected to the victim or to the others (it learns the rest of the cluster from
    the server either way): a fault costs a reconnect in the first case, only an election in the second.
    """
    leader = await stream_leader(cluster)
    victim = leader if name != "follower SIGKILL" else next(m for m in cluster.members if m is not leader)
    url = victim.url if client_on_victim else ",".join(m.url for m in cluster.members if m is not victim)
    publisher = Runtime("bench-fault", settings)
    await publisher.start(url)
    sent: list[str] = []
    worst = 0.0

    async def publish_for(seconds: float) -> None:
        nonlocal worst
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            pod = event()
            started = time.perf_counter()
            await publisher.publish(pod)
            worst = max(worst, time.perf_counter() - started)
            sent.append(pod.resource_version)

    await publish_for(0.5)
    before, worst = worst, 0.0
    if name == "leader SIGSTOP":
        victim.pause()
    else:
        victim.kill()
    await publish_for(fault_s)
    if name == "leader SIGSTOP":
        victim.resume()
    else:
        await asyncio.to_thread(victim.start)
    await publish_for(1.0)
    await publisher.stop()
    await asyncio.to_thread(victim.wait_until_current, 30)
    ours = set(sent)
    stored = [i for i in await stored_ids(cluster.url) if i in ours]
    return {"fault": name, "on_victim": client_on_victim, "worst_wait_s": worst, "steady_worst_s": before, "sent": len(sent),
            "stored": len(set(stored)), "twice": len(stored) - len(set(stored))}


async def pipelined_fault(cluster: EmbeddedCluster, settings: BusSettings, name: str, client_on_victim: bool, fault_s: float,
                          lanes: int, resend: bool) -> dict[str, object]:
    """As `fault`, with `lanes` publishes in flight through the watcher's AckPipeline, each retried until stored
    as the watcher's lanes retry (its default backoff); `resend`: what awaits its ack is sent again on a lost connection."""
    leader = await stream_leader(cluster)
    victim = leader if name != "follower SIGKILL" else next(m for m in cluster.members if m is not leader)
    url = victim.url if client_on_victim else ",".join(m.url for m in cluster.members if m is not victim)
    runtime = Runtime("bench-pipelined", settings)
    await runtime.start(url)
    acks = AckPipeline(runtime.connection, settings.jetstream_timeout_s, limit=4 * lanes)
    await acks.start()
    if resend:
        runtime.on_disconnected(acks.resend)
    watcher = WatcherSettings()
    sent: list[str] = []
    waits: list[float] = []
    until = 0.0

    async def lane() -> None:
        while time.monotonic() < until:
            pod = event()
            data = encode(pod, runtime.service)
            headers = {"Nats-Msg-Id": pod.dedup_id(), "Content-Type": HEADERS_CONTENT_TYPE}
            started, delay = time.perf_counter(), watcher.backoff_base_s
            while True:
                try:
                    await acks.publish(pod.subject(), data, headers)
                    break
                except (nats.errors.Error, asyncio.TimeoutError):  # the watcher's _retrying: wait, then the same again
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, watcher.backoff_max_s)
            waits.append(time.perf_counter() - started)
            sent.append(pod.resource_version)

    async def publish_for(seconds: float) -> float:
        nonlocal until
        until, first = time.monotonic() + seconds, len(waits)
        await asyncio.gather(*(lane() for _ in range(lanes)))
        return max(waits[first:], default=0.0)

    before = await publish_for(0.5)
    if name == "leader SIGSTOP":
        victim.pause()
    else:
        victim.kill()
    worst = await publish_for(fault_s)
    if name == "leader SIGSTOP":
        victim.resume()
    else:
        await asyncio.to_thread(victim.start)
    worst = max(worst, await publish_for(1.0))
    await acks.stop()
    await runtime.stop()
    await asyncio.to_thread(victim.wait_until_current, 30)
    ours = set(sent)
    stored = [i for i in await stored_ids(cluster.url) if i in ours]
    return {"fault": name, "on_victim": client_on_victim, "resend": resend, "worst_wait_s": worst, "steady_worst_s": before,
            "sent": len(sent), "stored": len(set(stored)), "twice": len(stored) - len(set(stored))}


@dataclass
class Outage:
    """What one client met while a server was down (or, for the baseline, over as long without a fault)."""

    fault: str
    victim: str = ""
    elected_s: float | None = None
    consumer_elected_s: float | None = None
    publish_s: float = 0.0
    kv_s: float = 0.0
    handler_s: float = 0.0
    failover_s: float | None = None
    sent: int = 0
    stored: int = 0
    twice: int = 0


async def outage(cluster: EmbeddedCluster, settings: BusSettings, fault: str | None, seconds: float) -> Outage:
    """One publish, one KV put and get at a time for `seconds`, a durable consumer handling the events; with `fault`
    (one of DOWN_FAULTS) that server SIGKILLed first and started again only after `seconds`."""
    stream = (await stream_leader(cluster)).server_name
    bucket = (await cluster.step_down(f"KV_{DOWN_BUCKET}", {stream})).server_name
    victim = {"stream leader": stream, "bucket leader": bucket}.get(fault or "")
    if fault == "client's server":
        victim = next(m.server_name for m in cluster.members if m.server_name not in (stream, bucket))
    killed = cluster.member(victim) if victim else None
    # The client's server: the client is given that one alone (it learns the others from it, as behind a Service).
    url = killed.url if fault == "client's server" and killed else ",".join(m.url for m in cluster.members if m is not killed)
    acked: dict[str, float] = {}
    handled: dict[str, float] = {}

    async def handler(pod: PodIsolation) -> None:
        handled.setdefault(pod.resource_version, time.monotonic())

    runtime = Runtime("bench-down", settings, kv_buckets=[DOWN_BUCKET])
    consumer = f"bench-down-handler-{next(_ids)}"
    runtime.on_event(consumer.removeprefix("bench-down-"), subjects.ALL_PODS, handler, new_only=True)
    await runtime.start(url)
    kv = runtime.kv(DOWN_BUCKET)
    await kv.put("probe", b"start")
    result = Outage(fault or "no fault (baseline)", victim or "")
    led = {"stream leader": subjects.STREAM_NAME, "bucket leader": f"KV_{DOWN_BUCKET}"}.get(fault or "")
    observer = await nats.connect([m.url for m in cluster.members if m is not killed], connect_timeout=2)

    async def elected(msg: Msg) -> None:  # the new leader of what the victim led, as the cluster announces it
        if result.elected_s is None and msg.subject.endswith(f"STREAM.LEADER_ELECTED.{led}"):
            result.elected_s = time.monotonic() - started
        if result.consumer_elected_s is None and msg.subject.endswith(f".{consumer}"):
            result.consumer_elected_s = time.monotonic() - started

    async def failover(started: float) -> None:
        assert killed is not None
        while runtime.connection.connected_url is None or runtime.connection.connected_url.port == killed.port \
                or not runtime.connection.is_connected:
            await asyncio.sleep(0.005)
        result.failover_s = time.monotonic() - started

    async def one_round() -> tuple[float, float]:
        """(a publish's wait, a KV put and get's wait)."""
        pod = event()
        begun = time.monotonic()
        await runtime.publish(pod)
        acked[pod.resource_version] = time.monotonic()
        published = acked[pod.resource_version] - begun
        begun = time.monotonic()
        while True:  # a read and a compare-and-set, as a lease or a verifier claim; asked again at once when it fails
            try:
                entry = await kv.get("probe")
                await kv.update("probe", pod.resource_version.encode(), last=entry.revision)
                break
            except (nats.errors.Error, asyncio.TimeoutError):  # a refused compare-and-set too: an earlier copy landed
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.05)
        return published, time.monotonic() - begun

    warm_until = time.monotonic() + 1.0  # a connection made a moment ago is retried only after reconnect_time_wait
    while time.monotonic() < warm_until:
        await one_round()
    if killed is not None:
        killed.kill()
    started = time.monotonic()
    if killed is not None:  # after the kill: an election takes seconds, and one left over from the step-down must not count
        await observer.subscribe("$JS.EVENT.ADVISORY.*.LEADER_ELECTED.>", cb=elected)
    watch = asyncio.create_task(failover(started)) if fault == "client's server" else None
    while time.monotonic() - started < seconds:
        published, kv_wait = await one_round()
        result.publish_s, result.kv_s = max(result.publish_s, published), max(result.kv_s, kv_wait)
    if watch is not None:
        await watch
    if killed is not None:
        await asyncio.to_thread(killed.start)
    settled = time.monotonic() + 30  # a bound on the handler catching up, not a speed figure
    while len(handled) < len(acked) and time.monotonic() < settled:
        await asyncio.sleep(0.05)
    await runtime.stop()
    await observer.close()
    ends = time.monotonic()
    # Every event, those of the second before the kill too: one delivered by a leader as it died waits for its redelivery.
    result.handler_s = max(handled.get(rv, ends) - at for rv, at in acked.items())
    ours = set(acked)
    stored = [i for i in await stored_ids(cluster.url) if i in ours]
    result.sent, result.stored, result.twice = len(acked), len(set(stored)), len(stored) - len(set(stored))
    return result


def print_outages(baseline: Outage, outages: list[Outage], down_s: float) -> None:
    print(f"\na server kept down {down_s:g} s (SIGKILL, started again after): the longest wait while it was down, one client "
          f"publishing, reading and compare-and-setting a KV key, handling; x = ratio to the no-fault run of {BASELINE_S:g} s; "
          "elected: the new leader of what the victim led, and of the handler's consumer if it led that, announced "
          "(JetStream's own elections: the floor of a stall)")
    print(f"{'fault':<22}{'victim':<8}{'elected':>9}{'publish':>9}{'x':>7}{'kv op':>9}{'x':>7}{'consumer':>10}{'handler':>9}{'x':>7}"
          f"{'failover':>10}{'sent':>7}{'stored':>8}{'twice':>7}")

    def ratio(value: float, base: float) -> str:
        return f"{value / max(base, 1e-6):>6.0f}x"

    for o in [baseline, *outages]:
        failover = f"{o.failover_s:>9.2f}s" if o.failover_s is not None else f"{'-':>10}"
        elected = f"{o.elected_s:>8.2f}s" if o.elected_s is not None else f"{'-':>9}"
        consumer = f"{o.consumer_elected_s:>9.2f}s" if o.consumer_elected_s is not None else f"{'-':>10}"
        print(f"{o.fault:<22}{o.victim:<8}{elected}{o.publish_s:>8.3f}s{ratio(o.publish_s, baseline.publish_s)}{o.kv_s:>8.3f}s"
              f"{ratio(o.kv_s, baseline.kv_s)}{consumer}{o.handler_s:>8.3f}s{ratio(o.handler_s, baseline.handler_s)}{failover}"
              f"{o.sent:>7}{o.stored:>8}{o.twice:>7}")


async def main(count: int, rounds: int, fault_s: float, down_s: float, ping_interval_s: float | None,
               jetstream_timeout_s: float | None, lanes: int, only: set[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="kai-bench-cluster-") as store:
        single = EmbeddedNats(Path(store) / "single")
        cluster = EmbeddedCluster(Path(store) / "cluster")
        single.start()
        cluster.start()
        try:
            extra: dict[str, float] = {}
            if ping_interval_s:
                extra["nats_ping_interval_s"] = ping_interval_s
            if jetstream_timeout_s:
                extra["jetstream_timeout_s"] = jetstream_timeout_s
            one = BusSettings(nats_url=single.url, nats_replicas=1, **extra)
            three = BusSettings(nats_url=cluster.url, nats_replicas=3, **extra)
            results = {"one server (R1)": Steady(), "3-node cluster (R3)": Steady()}
            for r in range(rounds if "steady" in only else 0):  # interleaved, so drift in machine load hits both alike
                await steady_round(single.url, one, count, results["one server (R1)"], f"one-{r}")
                await steady_round(cluster.url, three, count, results["3-node cluster (R3)"], f"three-{r}")
            setup = Runtime("bench-setup", three, kv_buckets=[DOWN_BUCKET])  # the stream, when no steady round made it
            await setup.start(cluster.url)
            await setup.stop()
            kinds = [(name, on_victim) for name in ("leader SIGKILL", "follower SIGKILL", "leader SIGSTOP") for on_victim in (False, True)]
            faults = [await fault(cluster, three, name, on_victim, fault_s) for name, on_victim in kinds if "sequential" in only]
            pipelined = [await pipelined_fault(cluster, three, name, on_victim, fault_s, lanes, resend)
                         for name, on_victim in kinds if "pipelined" in only for resend in (False, True)]
            baseline = await outage(cluster, three, None, BASELINE_S) if "down" in only else None
            outages = [await outage(cluster, three, name, down_s) for name in DOWN_FAULTS if "down" in only]
        finally:
            single.stop()
            cluster.stop()
        if "steady" in only:
            print_steady(results, rounds, count)
        print(f"\nfaults on the cluster, {fault_s:g}s each (ping interval {three.nats_ping_interval_s:g}s, "
              f"JetStream timeout {three.jetstream_timeout_s:g}s, publish retry {three.publish_retry_s:g}s):")
        if faults:
            print_faults("publishing one at a time (Runtime.publish)", faults)
        if pipelined:
            print_pipelined(pipelined, lanes)
        if baseline is not None:
            print_outages(baseline, outages, down_s)


def print_steady(results: dict[str, Steady], rounds: int, count: int) -> None:
    print(f"steady state: {rounds} interleaved rounds; {count} sequential publishes (one in flight, a consumer beside) "
          f"and {count * 4} with {IN_FLIGHT} in flight per round and setup")
    print(f"{'':<22}{'publish p50':>12}{'publish p99':>12}{'event p50':>11}{'event p99':>11}{'events/s':>11}")
    figures = {}
    for label, steady in results.items():
        f = figures[label] = (percentile(steady.publish_ms, 50), percentile(steady.publish_ms, 99),
                              percentile(steady.delivery_ms, 50), percentile(steady.delivery_ms, 99), statistics.median(steady.rate))
        print(f"{label:<22}{f[0]:>10.2f}ms{f[1]:>10.2f}ms{f[2]:>9.2f}ms{f[3]:>9.2f}ms{f[4]:>11,.0f}")
    a, b = figures["3-node cluster (R3)"], figures["one server (R1)"]
    print(f"{'ratio R3/R1':<22}{a[0] / b[0]:>12.2f}{a[1] / b[1]:>12.2f}{a[2] / b[2]:>11.2f}{a[3] / b[3]:>11.2f}{a[4] / b[4]:>11.2f}")


def print_faults(title: str, faults: list[dict[str, object]]) -> None:
    print(title)
    print(f"{'fault':<18}{'client on':<12}{'worst wait':>11}{'steady worst':>14}{'sent':>7}{'stored':>8}{'twice':>7}")
    for f in faults:
        where = "the victim" if f["on_victim"] else "the others"
        print(f"{f['fault']:<18}{where:<12}{f['worst_wait_s']:>10.2f}s{f['steady_worst_s']:>13.3f}s{f['sent']:>7}{f['stored']:>8}{f['twice']:>7}")


def print_pipelined(faults: list[dict[str, object]], lanes: int) -> None:
    print(f"\nthe watcher's pipelined publishing, {lanes} lanes: worst publish wait (until stored) without / with the send again on a lost connection")
    print(f"{'fault':<18}{'client on':<12}{'without':>9}{'with':>8}{'ratio':>7}{'steady worst':>14}{'sent':>7}{'stored':>8}{'twice':>7}")
    for without, with_ in zip(faults[0::2], faults[1::2], strict=True):
        where = "the victim" if with_["on_victim"] else "the others"
        ratio = float(without["worst_wait_s"]) / max(float(with_["worst_wait_s"]), 1e-6)  # type: ignore[arg-type]
        for f in (without, with_):
            assert f["stored"] == f["sent"] and f["twice"] == 0, f"events lost or stored twice: {f}"
        print(f"{with_['fault']:<18}{where:<12}{without['worst_wait_s']:>8.2f}s{with_['worst_wait_s']:>7.2f}s{ratio:>6.1f}x"
              f"{with_['steady_worst_s']:>13.3f}s{with_['sent']:>7}{with_['stored']:>8}{with_['twice']:>7}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1000, help="sequential publishes per round and kind (x4 for events/s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fault-s", type=float, default=20.0, help="how long each fault lasts before the server is back")
    parser.add_argument("--down-s", type=float, default=60.0, help="how long each server stays down in the kept-down part")
    parser.add_argument("--ping-interval-s", type=float, default=None, help="client ping interval (default: the services' default)")
    parser.add_argument("--jetstream-timeout-s", type=float, default=None,
                        help="how long one publish waits for its ack before retrying (default: the services' default)")
    parser.add_argument("--lanes", type=int, default=16, help="pipelined publishes in flight for the watcher's fault rows")
    parser.add_argument("--only", default="steady,sequential,pipelined,down", help="which parts to run, comma separated")
    options = parser.parse_args()
    asyncio.run(main(options.events, options.rounds, options.fault_s, options.down_s, options.ping_interval_s,
                     options.jetstream_timeout_s, options.lanes, set(options.only.split(","))))
