"""Small helpers the tests share."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from kai_isolator.services.devcluster.build import cache_root, locked
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError
from kai_isolator.shared.events import Payload

RuntimeFactory = Callable[..., Awaitable[Runtime]]
Built = TypeVar("Built")


def build_before_tests(config: pytest.Config, items: list[pytest.Item], fixtures: set[str], build: Callable[[], Built],
                       failure: type[Exception] | tuple[type[Exception], ...]) -> Built | Exception | None:
    """Build what tests using `fixtures` need once, before any runs: outside every test's timeout, progress on the terminal.

    A build failure is returned, not raised: the tests that need it fail with it, the rest of the suite still runs.
    """
    if not any(fixtures & set(getattr(item, "fixturenames", ())) for item in items):
        return None
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        try:
            # Every xdist worker builds what its tests need: the first builds, the others wait and find the cache warm
            # (concurrent mmdebstrap runs or image builds of one tag would race).
            with locked(cache_root() / "test-builds.lock"):
                return build()
        except failure as error:
            return error


async def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until `predicate()` holds; fail the test if it does not within the timeout."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def publish_until_stored(runtime: Runtime, event: Payload) -> None:
    """At-least-once publishing through an outage; the Nats-Msg-Id makes a retry harmless."""
    while True:
        try:
            await runtime.publish(event)
            return
        except BusError:
            await asyncio.sleep(0.1)


# Run in a child interpreter that is the command's subreaper (prctl PR_SET_CHILD_SUBREAPER): whatever the command leaves
# running is re-parented to it, never to init, so "left nothing running" is judged by lineage, not by a machine-wide
# search that a parallel test's processes would confuse. It prints the outcome as JSON and kills what was left.
_SUBREAPER = r"""
import ctypes, json, os, signal, subprocess, sys, tempfile
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
# Files, not pipes: a process left behind would hold a pipe open, and reading it would wait for that process.
with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    try:
        returncode = subprocess.run(sys.argv[2:], stdout=out, stderr=err, timeout=float(sys.argv[1])).returncode
    except subprocess.TimeoutExpired:
        returncode = 124  # the command was killed; what it started is still named and killed below
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
def stat(pid):
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return "X", 0
pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
states = {pid: stat(pid) for pid in pids}
def children(pid):
    return [child for child, (_, parent) in states.items() if parent == pid]
def alive(pid):
    return states[pid][0] not in "ZX"
left, todo = [], children(os.getpid())
while todo:
    pid = todo.pop()
    todo += children(pid)
    if alive(pid):
        left.append(f"{pid} " + open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip())
for entry in left:
    try:
        os.kill(int(entry.split()[0]), signal.SIGKILL)
    except OSError:
        pass
print(json.dumps({"returncode": returncode, "stdout": stdout, "stderr": stderr, "left": left}))
"""


@dataclass(frozen=True)
class Finished:
    """A command that has ended: its exit status, its output, and every process it left running (`PID cmdline`)."""

    returncode: int
    stdout: str
    stderr: str
    left: list[str]


def run_leaving_nothing(argv: list[str], cwd: Path, timeout_s: float) -> Finished:
    """Run `argv` to its end and name the processes it left behind (they are killed afterwards)."""
    done = subprocess.run([sys.executable, "-c", _SUBREAPER, str(timeout_s), *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s + 30, check=False)
    if done.returncode != 0:
        raise AssertionError(f"the subreaper around {argv} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Finished(**json.loads(done.stdout))
