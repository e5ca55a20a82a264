"""The runtime under process signals and a crashing nats-server: nothing lost, nothing handled twice needlessly."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import Counter
from pathlib import Path

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime, connect, end_connection
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.errors import BusError
from kai_isolator.shared.events import HealthVerdict, PodIsolation
from kai_isolator.shared.settings import BusSettings
from support.bus import RuntimeFactory, pod_event, publish_until_stored
from support.waiting import eventually

DRAIN_SERVICE = Path(__file__).with_name("drain_service.py")


async def start_drain_service(url: str, journal: Path) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, str(DRAIN_SERVICE), url, str(journal))


async def test_sigterm_finishes_the_message_in_hand_and_returns_the_rest(
    bus_settings: BusSettings, start_runtime: RuntimeFactory, tmp_path: Path
) -> None:
    verdicts: list[HealthVerdict] = []

    async def collect(event: HealthVerdict) -> None:
        verdicts.append(event)

    observer = await start_runtime("observer", lambda r: r.on_event("health", subjects.ALL_HEALTH, collect))
    for name in ("p1", "p2", "p3"):
        await observer.publish(pod_event(name, namespace="ns"))
    journal = tmp_path / "journal"
    first = await start_drain_service(bus_settings.nats_url or "", journal)
    await eventually(lambda: journal.exists() and "start p1" in journal.read_text())
    first.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(first.wait(), 15) == 0
    assert journal.read_text().splitlines() == ["start p1", "done p1"]  # finished, and took no more

    second = await start_drain_service(bus_settings.nats_url or "", journal)
    await eventually(lambda: len(verdicts) == 3, timeout_s=20)
    second.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(second.wait(), 15) == 0
    handled = [line.split()[1] for line in journal.read_text().splitlines() if line.startswith("done")]
    assert sorted(handled) == ["p1", "p2", "p3"]  # p1 was acked before exit: never handled again
    assert sorted(v.pod.name for v in verdicts) == ["p1", "p2", "p3"]



async def test_nats_server_crash_and_restart_loses_nothing(
    nats_server: EmbeddedNats, bus_settings: BusSettings, start_runtime: RuntimeFactory
) -> None:
    total = 300
    handled: list[str] = []

    async def record(event: PodIsolation) -> None:
        handled.append(event.pod.name)

    await start_runtime("consumer", lambda r: r.on_event("pods", subjects.ALL_PODS, record))
    publisher = await start_runtime("publisher")

    async def publish_all() -> None:
        for i in range(total):
            await publish_until_stored(publisher, pod_event(f"p{i}", namespace="ns"))
            await asyncio.sleep(0.002)

    publishing = asyncio.create_task(publish_all())
    await eventually(lambda: len(handled) >= 50)
    assert not publishing.done()  # the crash really happens mid-stream
    nats_server.kill()  # SIGKILL: no goodbye to the clients
    await asyncio.sleep(0.5)
    nats_server.start()
    await publishing
    await eventually(lambda: len(set(handled)) == total, timeout_s=30)

    assert set(handled) == {f"p{i}" for i in range(total)}
    repeats = sum(n - 1 for n in Counter(handled).values())
    # Only acks lost with the dying connection may be redelivered: at most one fetch batch.
    assert repeats <= bus_settings.fetch_batch


async def test_embedded_default_starts_and_stops_a_private_server() -> None:
    from kai_isolator.shared.embedded_nats import bus_url

    settings = BusSettings(nats_url=None)
    async with bus_url(settings) as url:
        runtime = Runtime("svc", settings)
        await runtime.start(url)
        await runtime.publish(pod_event("p1", namespace="ns"))
        info = await runtime.jetstream.stream_info(subjects.STREAM_NAME)
        assert info.state.messages == 1
        await runtime.stop()
    port = int(url.rsplit(":", 1)[1])
    reader = asyncio.open_connection("127.0.0.1", port)
    try:
        await asyncio.wait_for(reader, 2)
        raise AssertionError("embedded server still accepting after exit")
    except OSError:
        pass


async def test_first_connection_fails_clearly_when_nothing_listens() -> None:
    from kai_isolator.shared.ports import free_port

    settings = BusSettings(nats_url=f"nats://127.0.0.1:{free_port()}", nats_connect_timeout_s=0.5)
    runtime = Runtime("svc", settings)
    try:
        await runtime.start(settings.nats_url or "")
        raise AssertionError("connected to nothing")
    except BusError as error:
        assert "cannot reach NATS" in str(error)


async def test_a_cancelled_stop_ends_cancelled_though_the_drain_swallows_it(bus_settings: BusSettings) -> None:
    """nats-py's drain catches a cancel of its caller and returns; ending the connection must not lose that
    cancel, or a service stop cancelled from outside runs on as if nothing had asked it to end."""
    nc = await connect(bus_settings, bus_settings.nats_url or "", "drain-cancel")
    handling = asyncio.Event()

    async def slow(_msg: object) -> None:
        handling.set()
        await asyncio.sleep(30)  # the drain waits for this message to be handled

    await nc.subscribe("slow", cb=slow)
    await nc.publish("slow", b"x")
    await asyncio.wait_for(handling.wait(), 5)
    ending = asyncio.create_task(end_connection(nc))
    await asyncio.sleep(0.3)  # inside the drain
    ending.cancel()
    done, _ = await asyncio.wait({ending}, timeout=10)
    assert done and ending.cancelled()
    assert nc.is_closed
