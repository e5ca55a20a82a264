"""`kai-isolator events` and `dev` under NATS faults: a server SIGKILLed and restarted, a list of servers."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.events import NodeStatus, decode
from kai_isolator.shared.ports import free_port
from support.bus import RuntimeFactory, publish_until_stored

CLI = [sys.executable, "-m", "kai_isolator.services.cli"]


def status(sequence: int) -> NodeStatus:
    return NodeStatus(node_name="gpu-1", sequence=sequence, ready=True, active_version="abc123")



@pytest.fixture
async def cli() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Processes started by a test; killed at teardown if the test left them running."""
    started: list[asyncio.subprocess.Process] = []
    yield started
    for process in started:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def start_cli(started: list[asyncio.subprocess.Process], *args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        *CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    started.append(process)
    return process


async def read_lines(process: asyncio.subprocess.Process, count: int, timeout_s: float = 30) -> list[str]:
    assert process.stdout is not None
    lines = []
    for _ in range(count):
        line = await asyncio.wait_for(process.stdout.readline(), timeout_s)
        assert line, f"exited early: {(await process.stderr.read()).decode() if process.stderr else ''}"
        lines.append(line.decode().rstrip("\n"))
    return lines


async def stopped_within(process: asyncio.subprocess.Process, timeout_s: float) -> tuple[bytes, bytes]:
    """Its remaining output once it has exited; a test failure naming where its shutdown stood if it has not."""
    try:
        return await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)
        _, err = await process.communicate()
        last = b"\n".join(err.splitlines()[-15:]).decode(errors="replace")
        pytest.fail(f"still running {timeout_s:g} s after SIGINT (killed); its last log lines:\n{last}")


def sequences(lines: list[str]) -> list[int]:
    return [decode(line.encode())[1].sequence for line in lines]  # type: ignore[attr-defined]


async def test_events_since_delivers_every_event_once_through_a_nats_crash_and_restart(
    nats_server: EmbeddedNats, start_runtime: RuntimeFactory, cli: list[asyncio.subprocess.Process]
) -> None:
    publisher = await start_runtime("publisher")
    for sequence in range(3):
        await publisher.publish(status(sequence))
    follower = await start_cli(cli, "events", "--nats-url", nats_server.url, "--since", "10m", "--json", "--limit", "7")
    assert sequences(await read_lines(follower, 3)) == [0, 1, 2]

    nats_server.kill()  # SIGKILL: the follower's consumer dies with the server
    await asyncio.sleep(1.0)
    nats_server.start()  # same port, same store: the stream and its events are still there
    for sequence in range(3, 7):
        await publish_until_stored(publisher, status(sequence))

    assert sequences(await read_lines(follower, 4, timeout_s=60)) == [3, 4, 5, 6]  # none lost, none repeated
    assert await asyncio.wait_for(follower.wait(), 30) == 0  # --limit 7 reached: exactly seven events came


async def test_events_accepts_a_comma_separated_nats_url(
    nats_server: EmbeddedNats, start_runtime: RuntimeFactory, cli: list[asyncio.subprocess.Process]
) -> None:
    publisher = await start_runtime("publisher")
    await publisher.publish(status(0))
    servers = f"{nats_server.url},nats://127.0.0.1:{free_port()}"  # a cluster's seed list, one seed down
    for how in (["--nats-url", servers], []):
        follower = await start_cli(cli, "events", *how, "--since", "10m", "--json", "--limit", "1",
                                   env={"KAI_ISOLATOR_NATS_URL": servers})
        assert sequences(await read_lines(follower, 1)) == [0]
        assert await asyncio.wait_for(follower.wait(), 30) == 0


async def test_a_nats_url_list_with_no_url_is_a_clear_error(cli: list[asyncio.subprocess.Process]) -> None:
    process = await start_cli(cli, "events", "--nats-url", " , ")
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2
    assert b"expected one or more NATS URLs" in err and b"Traceback" not in err


async def test_dev_runs_every_service_on_a_comma_separated_nats_url_and_says_which(
    nats_server: EmbeddedNats, tmp_path: Path, cli: list[asyncio.subprocess.Process]
) -> None:
    servers = f"{nats_server.url},nats://127.0.0.1:{free_port()}"
    process = await start_cli(cli, "dev", env={"KAI_ISOLATOR_NATS_URL": servers, "TMPDIR": str(tmp_path)})
    assert process.stdout is not None and process.stderr is not None
    banner = ""
    while "Ctrl-C to stop" not in banner:
        line = await asyncio.wait_for(process.stdout.readline(), 90)
        assert line, f"dev exited before it was ready: {(await process.stderr.read()).decode()}"
        banner = line.decode()
    assert f"the NATS at {servers}" in banner and "embedded" not in banner
    os.killpg(process.pid, signal.SIGINT)
    rest, err = await stopped_within(process, 60)
    assert process.returncode == 0, err.decode()
    assert b"kai-isolator dev: stopped" in rest and b"Traceback" not in err


async def test_demo_timeline_goes_on_through_a_nats_crash_and_restart_on_a_url_list(
    nats_server: EmbeddedNats, tmp_path: Path, cli: list[asyncio.subprocess.Process]
) -> None:
    servers = f"{nats_server.url},nats://127.0.0.1:{free_port()}"
    demo = await start_cli(cli, "dev", "--demo", env={"KAI_ISOLATOR_NATS_URL": servers, "TMPDIR": str(tmp_path)})
    assert demo.stdout is not None
    out = []
    while True:
        line = (await asyncio.wait_for(demo.stdout.readline(), 120)).decode()
        if not line:
            break
        out.append(line)
        if line.startswith("kai-isolator demo:"):
            assert f"on the NATS at {servers}" in line  # the banner names the NATS really used
            nats_server.kill()  # SIGKILL while the demo's event reader and every service are on it
            await asyncio.sleep(1.0)
            nats_server.start()
    await demo.wait()
    text = "".join(out)
    # Every verdict after the restart reached the demo's event reader (it follows with `since`),
    # and the injected pod was never judged missing while its container was being set up. The
    # exit status is the later steps' business (e.g. the enforcer's), not this fault's.
    for seen in ("gpu-sharing-demo: VERIFIED", "opted-out: MISSING (not-injected)", "webhook-was-down: MISSING (not-injected)"):
        assert seen in text, text
    assert "gpu-sharing-demo: MISSING" not in text and "Traceback" not in text, text
