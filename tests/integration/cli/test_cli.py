"""The `kai-isolator` command as a user runs it: help, events tail, dev start and stop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from kai_isolator.shared import subjects
from kai_isolator.shared.events import NodeStatus, decode
from support.bus import RuntimeFactory

CLI = [sys.executable, "-m", "kai_isolator.services.cli"]


async def run_cli(*args: str, timeout_s: float = 30, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})}
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    return process.returncode or 0, out.decode(), err.decode()


async def test_help_lists_the_commands() -> None:
    code, out, _ = await run_cli("--help")
    assert code == 0
    assert "events" in out and "dev" in out


async def test_events_replays_the_stream_as_json_and_text(start_runtime: RuntimeFactory, nats_server) -> None:  # type: ignore[no-untyped-def]
    runtime = await start_runtime("publisher")
    for sequence in range(3):
        await runtime.publish(NodeStatus(node_name="gpu-1", sequence=sequence, ready=True, active_version="abc123"))
    await runtime.jetstream.publish(subjects.node_status("gpu-1"), b"garbage")

    code, out, err = await run_cli("events", "--nats-url", nats_server.url, "--since", "10m", "--limit", "4", "--json")
    assert code == 0, err
    lines = out.splitlines()
    assert [decode(line.encode())[1].sequence for line in lines[:3]] == [0, 1, 2]  # type: ignore[attr-defined]
    assert lines[3] == "garbage"

    code, out, err = await run_cli("events", "--nats-url", nats_server.url, "--since", "10m", "--limit", "4", "--subject", "isolator.node.*.status")
    assert code == 0, err
    lines = out.splitlines()
    assert all("io.kai-isolator.node.status.v1" in line and "active_version=abc123" in line for line in lines[:3])
    assert lines[3].startswith("!! undecodable message on isolator.node.gpu-1.status")


async def test_events_rejects_a_bad_since_clearly() -> None:
    code, _, err = await run_cli("events", "--since", "last tuesday")
    assert code == 2
    assert "--since expects a duration" in err


async def test_bad_env_value_is_a_clear_error_not_a_traceback() -> None:
    code, _, err = await run_cli("events", env={"KAI_ISOLATOR_LOG_LEVEL": "chatty"})
    assert code == 2 and "KAI_ISOLATOR_LOG_LEVEL" in err and "Traceback" not in err


async def test_dev_starts_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        *CLI, "dev", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True,
    )
    assert process.stdout is not None
    banner = b""
    while b"Ctrl-C to stop" not in banner:
        banner = await asyncio.wait_for(process.stdout.readline(), 60)
        assert banner, "dev exited before it was ready"
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group, as in a terminal
    rest = await asyncio.wait_for(process.stdout.read(), 30)
    assert await process.wait() == 0
    assert b"kai-isolator dev: stopped" in rest and b"Traceback" not in rest
    assert list(tmp_path.iterdir()) == []  # embedded store and work dirs removed
