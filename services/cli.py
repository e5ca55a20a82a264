"""`kai-isolator`: the one command-line entry point; each subcommand runs a service or a tool."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kai_isolator.shared import logs
from kai_isolator.shared.errors import IsolatorError
from kai_isolator.shared.settings import LogSettings, load

from . import dev, events_command, registry

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def command_modules() -> list[Any]:
    """Each has `add_parser(subparsers) -> ArgumentParser` and `async run(args) -> int`."""
    return [events_command, dev, *registry.command_modules()]


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="env KAI_ISOLATOR_LOG_LEVEL (default info)")
    parser.add_argument("--log-json", action="store_const", const=True, help="JSON log lines (env KAI_ISOLATOR_LOG_JSON)")


def add_bus_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", help="NATS URL (env KAI_ISOLATOR_NATS_URL); unset: start an embedded nats-server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kai-isolator",
        description="Enforce KAI-Scheduler GPU-sharing limits: webhook, node agent, libvgpu.so, and an event bus on NATS.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in command_modules():
        sub = module.add_parser(commands)
        add_common_flags(sub)
        add_bus_flags(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        logs.configure(load(LogSettings, args))
        code = asyncio.run(args.run(args))
    except IsolatorError as error:
        print(f"kai-isolator {args.command}: {error}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
