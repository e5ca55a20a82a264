"""`kai-isolator installer`: roll a libvgpu.so version out to the node agents, in batches."""

from __future__ import annotations

import argparse

from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.embedded_nats import bus_url
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.settings import BusSettings, load

from . import rollout

SERVICE = "installer"


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("installer", help="roll a library version out to the node agents, in batches", description=__doc__)
    parser.add_argument("--version", required=True, dest="target_version", help="library version (sha256 prefix) to activate")
    parser.add_argument("--max-unavailable", type=int, default=1, help="nodes upgraded at once (default 1)")
    parser.add_argument("--nodes", help="comma-separated node names (default: every node whose agent has reported)")
    parser.add_argument("--rollout-id", help="KV key of this rollout (default libvgpu-<version>); the same id resumes")
    parser.add_argument("--node-timeout-s", type=float, default=120.0, help="how long one node may take (default 120)")
    parser.add_argument("--lease-ttl-s", type=float, default=15.0, help="one rollout at a time across installers: another takes over after this long without renewal (default 15)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and change nothing")
    return parser


async def run(args: argparse.Namespace) -> int:
    rollout.batches([], args.max_unavailable)  # bad flags fail before connecting
    rollout.check_version(args.target_version)
    if args.lease_ttl_s <= 0:
        raise ConfigError(f"--lease-ttl-s must be positive, got {args.lease_ttl_s}")
    settings = load(BusSettings, args)
    only = [n.strip() for n in args.nodes.split(",") if n.strip()] if args.nodes else None
    async with bus_url(settings) as url:
        runtime = Runtime(SERVICE, settings, kv_buckets=[rollout.NODE_BUCKET, rollout.ROLLOUT_BUCKET, rollout.LEASE_BUCKET])
        await runtime.start(url)
        try:
            if args.dry_run:
                return await _print_plan(runtime, args.target_version, only, args.max_unavailable, args.rollout_id)
            state = await rollout.run_rollout(runtime, args.target_version, max_unavailable=args.max_unavailable, only=only,
                                              rollout_id=args.rollout_id, node_timeout_s=args.node_timeout_s, lease_ttl_s=args.lease_ttl_s)
        finally:
            await runtime.stop()
    if state.phase == "halted":
        print(f"rollout {state.rollout_id} halted at {state.failed_node}: {state.message}")
        print(f"done: {', '.join(state.done) or '-'}; not started: {', '.join(n for n in state.pending if n != state.failed_node) or '-'}")
        return 1
    print(f"rollout {state.rollout_id} completed: {', '.join(state.done) or 'every node was already there'}")
    return 0


async def _print_plan(runtime: Runtime, version: str, only: list[str] | None, size: int, rollout_id: str | None) -> int:
    rollout_id = rollout_id or rollout.default_rollout_id(version)
    state = await rollout.load_state(runtime, rollout_id)
    pending = state.pending if state and state.version == version and state.phase != "completed" else await rollout.plan(runtime, version, only)
    print(f"rollout {rollout_id}: version {version}, at most {size} node(s) at a time (dry run: nothing changes)")
    if state and state.phase != "completed":
        print(f"resuming from KV: done {', '.join(state.done) or '-'}")
    for number, batch in enumerate(rollout.batches(pending, size), 1):
        print(f"  batch {number}: {', '.join(batch)}")
    if not pending:
        print("  nothing to do: every node already runs this version with a passing self-check")
    return 0
