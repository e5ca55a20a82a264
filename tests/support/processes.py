"""Processes the tests run and judge: a command and everything it left running (by lineage), and our services as
child processes (`kai-isolator <service>`), their probes asked over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kai_isolator.shared.ports import free_port
from support.waiting import eventually


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


class ServiceProcess:
    """One of our services as a child process, its probes on 127.0.0.1:`port`, its output in `log`."""

    def __init__(self, process: asyncio.subprocess.Process, port: int, log: Path) -> None:
        self.process, self.port, self.log = process, port, log

    @property
    def pid(self) -> int:
        return self.process.pid

    def get(self, path: str) -> tuple[int, str]:
        """GET `path` from its probe server: the status and body, or (0, "") while nothing answers there."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            return 0, ""

    def metric(self, series: str) -> float:
        """The value of a Prometheus series (`name` or `name{labels}`), summed over its lines; 0 where absent."""
        _, text = self.get("/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series + " "))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


async def start_service(args: list[str], env: dict[str, str], logs: Path, *, ready: str | None = "/readyz",
                        ready_timeout_s: float = 30) -> ServiceProcess:
    """`kai-isolator <args>` in a child process with its probes on a free port and `env` over this environment, its
    output in `logs`/<service>-<port>.log; returned once `ready` answers 200 (None: at once)."""
    port = free_port()
    log = logs / f"{args[0]}-{port}.log"
    with log.open("ab") as out:  # the child keeps writing it after this process closes its copy
        process = await asyncio.create_subprocess_exec(sys.executable, "-m", "kai_isolator.services.cli", *args,
                                                       "--probe-listen", f"127.0.0.1:{port}", env={**os.environ, **env},
                                                       stdout=out, stderr=out)
    service = ServiceProcess(process, port, log)
    if ready is not None:
        await eventually(lambda: service.get(ready)[0] == 200, timeout_s=ready_timeout_s)
    return service
