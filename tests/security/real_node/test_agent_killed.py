"""The node agent SIGKILLed and kept down 30 s while an attack runs (issue 41), on the real node with NRI on, for both
kinds of fake driver. The agent runs as its own process here (`kai-isolator nodeagent`, as its DaemonSet's container
runs it), so the kill is a real one: no goodbye, its decision socket and enforcer gone at once.

- 615: the cap the driver holds on the seed's pod's leaf is the driver's, not the agent's: the seed's pod asking the raw
  driver for 8 GiB with the agent down gets CUDA_ERROR_OUT_OF_MEMORY at the grant, and the ledger never holds more.
- 580: nothing acts on a raw-driver escape while the agent is down: the 8 GiB is held until the restarted agent's
  enforcer kills it. The test reports how long and how much, against the time the agent takes to come back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kai_isolator.services.dev import DevContext
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.shared.settings import ENV_PREFIX
from support import run_summary
from support.real_node import SEED_POD, SEED_POD_NAME, LedgerWatch, Node, isolated, ledger

GIB, MIB = 1 << 30, 1 << 20
ASKED = 8 * GIB
SEED_GRANT_MIB = 4147
DOWN_S = 30
READY_TIMEOUT_S = 90
SECTION = "the node agent SIGKILLed for 30 s during an attack (tests/security/real_node/test_agent_killed.py)"
HEADER = (f"{'driver':<8} {'attack':<30} {'peak over':>10} {'over the grant':>15} {'MiB*s over':>11} {'agent back in':>14}  outcome")


class AgentProcess:
    """The node agent as its own process, from the settings the module's in-process agent ran with."""

    def __init__(self, settings: NodeAgentSettings, nats_url: str, log: Path) -> None:
        self.env = {**os.environ, **settings_env(settings), f"{ENV_PREFIX}NATS_URL": nats_url, f"{ENV_PREFIX}PROBE_LISTEN": "127.0.0.1:0"}
        self.log = log
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> float:
        """Start it; the seconds until it serves (its first line, printed once it watches pods and answers NRI)."""
        began = time.monotonic()
        with self.log.open("a") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "kai_isolator.services.cli", "nodeagent"], env=self.env,
                                            stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        assert self.process.stdout is not None
        line = first_line(self.process.stdout, READY_TIMEOUT_S)
        assert line.startswith("{"), f"the node agent did not come up: {line!r}; its log: {self.log}"
        assert json.loads(line)["node"] == "gpu-node-1"
        return time.monotonic() - began

    def kill(self) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def settings_env(settings: NodeAgentSettings) -> dict[str, str]:
    """The settings as the agent's environment (KAI_ISOLATOR_*; lists as JSON, as pydantic-settings reads them)."""
    values = settings.model_dump(mode="json", exclude_none=True)
    return {f"{ENV_PREFIX}{name.upper()}": json.dumps(value) if isinstance(value, list) else str(value) for name, value in values.items()}


def first_line(stream: object, timeout_s: float) -> str:
    """The stream's first line, or "" if none came within the bound (a reader thread: a pipe has no timeout)."""
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(stream.readline()), daemon=True)  # type: ignore[attr-defined]
    reader.start()
    reader.join(timeout_s)
    return found[0] if found else ""


def rawelf(node: Node, hold_ms: int) -> subprocess.CompletedProcess[str]:
    """The raw-driver escape in the seed's pod: 8 GiB through a raw ELF lookup of cuMemAlloc_v2, held `hold_ms`."""
    return node.plane.kubectl("exec", SEED_POD_NAME, "--", "rawelf", str(ASKED), str(hold_ms), check=False, timeout_s=180)


@pytest.fixture(scope="module", params=[580, 615], ids=["R580", "R615"])
def agent_process(request: pytest.FixtureRequest, real_node_session: Node, cuda_image: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevContext, AgentProcess]]:
    """Our services on the node with NRI on and the driver of the parameter's branch; the node agent, stopped in the
    test process, runs again as a process of its own."""
    node = real_node_session
    node.real.switch_driver(request.param)
    workdir = tmp_path_factory.mktemp(f"agent-killed-{request.param}")
    try:
        with isolated(node, workdir, nri=True) as ctx:
            in_process = ctx.values["agent"]
            node.loop.run(in_process.stop(), 30)
            agent = AgentProcess(in_process.settings, ctx.nats_url, workdir / "nodeagent.log")
            agent.start()
            ctx.values["branch"] = request.param
            try:
                yield ctx, agent
            finally:
                agent.stop()
    finally:
        node.real.switch_driver(580)  # the session's other modules run on the default driver


@pytest.mark.timeout(360)  # the seed's pod, 30 s without the agent, its restart, and on R580 the kill
def test_an_attack_while_the_agent_is_sigkilled_for_30_s(agent_process: tuple[DevContext, AgentProcess], real_node: Node) -> None:
    ctx, agent = agent_process
    node, branch = real_node, ctx.values["branch"]
    node.kubectl("apply", "-f", "-", input_text=SEED_POD)
    node.made.append(("default", SEED_POD_NAME))
    node.wait_running(SEED_POD_NAME, timeout_s=120)

    with LedgerWatch(ledger(node), over=SEED_GRANT_MIB * MIB) as watch, ThreadPoolExecutor(1) as attacker:
        agent.kill()
        killed_at = time.monotonic()
        if branch == 615:
            # Asked at once and again near the end of the agent's absence: each answered by the driver alone.
            answers = [rawelf(node, hold_ms=1000)]
            time.sleep(max(0.0, killed_at + DOWN_S - 5 - time.monotonic()))
            answers.append(rawelf(node, hold_ms=1000))
        else:
            # Held up to 120 s, past the agent's absence: only the restarted enforcer can end it.
            held = attacker.submit(rawelf, node, 120_000)
        time.sleep(max(0.0, killed_at + DOWN_S - time.monotonic()))
        restart_s = agent.start()
        if branch == 580:
            answers = [held.result(timeout=200)]
        else:
            time.sleep(3)  # a few of the restarted enforcer's polls: nothing to act on
    status = node.pod(SEED_POD_NAME)["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and "running" in status["state"], status
    if branch == 615:
        # The driver's cap outlived the agent: refused at the grant, never over it, nothing killed.
        assert all(f"alloc {ASKED} rc=2" in a.stdout and a.returncode == 0 for a in answers), answers
        assert watch.first_over is None, f"the ledger held {watch.peak >> 20} MiB with the agent down"
        outcome = "refused by the driver's cap, twice, with the agent down"
    else:
        # Nothing acted while the agent was down; the restarted agent's enforcer killed it on its first polls.
        [done] = answers
        assert f"alloc {ASKED} rc=0" in done.stdout and done.returncode == 137, done
        assert watch.over_s is not None and watch.over_s >= DOWN_S - 2, watch.over_s
        outcome = f"held {watch.over_s:.1f} s, until the restarted agent's enforcer (back in {restart_s:.1f} s) killed it"
    run_summary.add(SECTION, f"R{branch:<7} {'seed pod, 8 GiB raw (rawelf)':<30} {watch.peak_over_mib:>6} MiB {watch.over_s or 0.0:>13.1f} s "
                             f"{watch.over_mib_s:>11.0f} {restart_s:>12.1f} s  {outcome}", header=HEADER)
