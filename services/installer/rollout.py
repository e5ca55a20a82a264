"""The rollout driver: moves node agents to a target library version in batches of at most
`max_unavailable` nodes, waits for each node's own report, halts at the first failure and
keeps its progress in KV so a restarted driver resumes where it stopped.

Replicas: one rollout at a time across all installers (the `installer.rollout` KV lease); a
second installer waits, and takes over (resuming from KV) when the holder dies."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from typing import Literal

import nats.js.errors
from nats.js.kv import KeyValue
from pydantic import BaseModel, Field, ValidationError

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.errors import BusError, ConfigError
from kai_isolator.shared.events import InstallReply, InstallRequest, NodeStatus, RolloutPhase, RolloutProgress
from kai_isolator.shared.lease import LEASE_BUCKET, Lease, holder_name
from kai_isolator.shared.tasks import cancel_all

log = logging.getLogger(__name__)

NODE_BUCKET = subjects.NODE_STATUS_BUCKET
"""Written by the node agents: node name -> latest NodeStatus (same name as the agent's setting)."""
ROLLOUT_BUCKET = "isolator_rollouts"
"""rollout id -> RolloutState."""
LEASE_KEY = "installer.rollout"
"""One lease for every rollout: two rollouts at once would each count the other's nodes as unavailable."""


class RolloutState(BaseModel):
    rollout_id: str
    version: str
    plan: list[str]
    done: list[str] = Field(default_factory=list)
    phase: Literal["progressing", "halted", "completed"] = "progressing"
    failed_node: str | None = None
    message: str = ""

    @property
    def pending(self) -> list[str]:
        return [n for n in self.plan if n not in self.done]


_VERSION = re.compile(r"^[0-9a-f]{16}$")


def check_version(version: str) -> str:
    """Versions are the agents' content addresses: 16 hex digits of the library's sha256."""
    if not _VERSION.match(version):
        raise ConfigError(f"--version must be 16 lowercase hex digits (a library's sha256 prefix), got {version!r}")
    return version


def default_rollout_id(version: str) -> str:
    return f"libvgpu-{version}"


def batches(nodes: Sequence[str], size: int) -> list[list[str]]:
    if size < 1:
        raise ConfigError(f"--max-unavailable must be at least 1, got {size}")
    return [list(nodes[i:i + size]) for i in range(0, len(nodes), size)]


async def node_statuses(runtime: Runtime) -> dict[str, NodeStatus]:
    """Every node agent's last status (listing keys leaves no consumer on the server)."""
    kv = runtime.kv(NODE_BUCKET)
    found = {}
    for key in await runtime.kv_keys(NODE_BUCKET):
        status = await _status(kv, key)
        if status is not None:
            found[key] = status
    return found


async def _status(kv: KeyValue, node: str) -> NodeStatus | None:
    return (await _entry(kv, node))[0]


async def _entry(kv: KeyValue, node: str) -> tuple[NodeStatus | None, int]:
    """The node's status and its KV revision (0 when absent)."""
    try:
        entry = await kv.get(node)
    except nats.js.errors.KeyNotFoundError:
        return None, 0
    try:
        return NodeStatus.model_validate_json(entry.value or b""), entry.revision or 0
    except ValidationError:
        log.warning("unreadable node status in KV", extra={"node": node})
        return None, entry.revision or 0


def is_at(status: NodeStatus | None, version: str) -> bool:
    return status is not None and status.active_version == version and status.self_check == "passed"


async def plan(runtime: Runtime, version: str, only: Sequence[str] | None) -> list[str]:
    """Nodes to move, in a stable order: every node with a status (or the ones named), minus those already there."""
    statuses = await node_statuses(runtime)
    names = sorted(only) if only else sorted(statuses)
    unknown = [n for n in names if n not in statuses]
    if unknown:
        raise ConfigError(f"no node agent has reported for: {', '.join(unknown)}")
    return [n for n in names if not is_at(statuses[n], version)]


async def load_state(runtime: Runtime, rollout_id: str) -> RolloutState | None:
    try:
        entry = await runtime.kv(ROLLOUT_BUCKET).get(rollout_id)
    except nats.js.errors.KeyNotFoundError:
        return None
    try:
        return RolloutState.model_validate_json(entry.value or b"")
    except ValidationError as error:
        raise ConfigError(f"rollout {rollout_id} has unreadable state in KV: {error.errors()[0]['msg']}") from None


async def save_state(runtime: Runtime, state: RolloutState) -> None:
    await runtime.kv(ROLLOUT_BUCKET).put(state.rollout_id, state.model_dump_json().encode())


async def run_rollout(runtime: Runtime, version: str, *, max_unavailable: int = 1, only: Sequence[str] | None = None,
                      rollout_id: str | None = None, node_timeout_s: float = 120.0, lease_ttl_s: float | None = None) -> RolloutState:
    """Drive the rollout to completion or to the first failing node.

    With `lease_ttl_s` (and LEASE_BUCKET provisioned) it first waits for the rollout lease and
    keeps it while driving; each step is checked against it (LeaseLostError when taken over).
    """
    check_version(version)
    rollout_id = rollout_id or default_rollout_id(version)
    subjects.encode_token(rollout_id)
    if lease_ttl_s is None:
        return await _drive(runtime, version, max_unavailable, only, rollout_id, node_timeout_s, None)
    lease = Lease(runtime.kv(LEASE_BUCKET), LEASE_KEY, holder_name("installer"), lease_ttl_s)
    await lease.acquire()
    keeper = asyncio.create_task(lease.keep(), name="rollout-lease")
    try:
        return await _drive(runtime, version, max_unavailable, only, rollout_id, node_timeout_s, lease)
    finally:
        await cancel_all([keeper])
        await lease.release()


async def _drive(runtime: Runtime, version: str, max_unavailable: int, only: Sequence[str] | None, rollout_id: str,
                 node_timeout_s: float, lease: Lease | None) -> RolloutState:
    def fence() -> None:
        if lease is not None:
            lease.check()

    state = await load_state(runtime, rollout_id)
    if state is not None and state.version != version:
        raise ConfigError(f"rollout {rollout_id} is for version {state.version}, not {version}; pick another --rollout-id")
    if state is None or state.phase == "completed":
        state = RolloutState(rollout_id=rollout_id, version=version, plan=await plan(runtime, version, only))
    else:
        log.info("resuming rollout from KV", extra={"rollout": rollout_id, "done": state.done, "phase": state.phase})
        state = state.model_copy(update={"phase": "progressing", "failed_node": None, "message": ""})
    fence()
    await save_state(runtime, state)
    await _announce(runtime, state, "progressing")
    for batch in batches(state.pending, max_unavailable):
        fence()
        results = await asyncio.gather(*(upgrade_node(runtime, node, version, rollout_id, node_timeout_s) for node in batch))
        failures = [(node, message) for node, (ok, message) in zip(batch, results, strict=True) if not ok]
        for node, (ok, _) in zip(batch, results, strict=True):
            if ok:
                state = state.model_copy(update={"done": [*state.done, node]})
                fence()
                await save_state(runtime, state)
                await _announce(runtime, state, "node-done", node)
        if failures:
            node, message = failures[0]
            state = state.model_copy(update={"phase": "halted", "failed_node": node, "message": message})
            await save_state(runtime, state)
            await _announce(runtime, state, "halted", node, message)
            log.error("rollout halted", extra={"rollout": rollout_id, "node": node, "error": message})
            return state
    state = state.model_copy(update={"phase": "completed"})
    await save_state(runtime, state)
    await _announce(runtime, state, "completed")
    return state


async def upgrade_node(runtime: Runtime, node: str, version: str, rollout_id: str, timeout_s: float) -> tuple[bool, str]:
    """Ask the node's agent to activate `version`, then wait for a newer status of its own to confirm it."""
    kv = runtime.kv(NODE_BUCKET)
    _, before = await _entry(kv, node)  # revisions, not clocks: the driver and the node may disagree on time
    try:
        reply = await runtime.request(InstallRequest(node_name=node, version=version, rollout_id=rollout_id), timeout_s)
    except BusError as error:
        return False, str(error)
    if not isinstance(reply, InstallReply) or not reply.ok:
        return False, getattr(reply, "message", "") or "install refused"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, revision = await _entry(kv, node)
        if status is not None and revision > before:
            if is_at(status, version):
                return True, status.message
            if status.self_check == "failed":
                return False, f"self-check failed: {status.message}"
        await asyncio.sleep(0.2)
    return False, f"no report of version {version} with a passing self-check within {timeout_s}s"


async def _announce(runtime: Runtime, state: RolloutState, phase: RolloutPhase, node: str | None = None, message: str = "") -> None:
    await runtime.publish(RolloutProgress(
        rollout_id=state.rollout_id, version=state.version, phase=phase, node_name=node,
        done_nodes=state.done, pending_nodes=state.pending, message=message or state.message,
    ))
