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

from . import registry

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def command_modules(only: str | None = None) -> list[Any]:
    """Each has `add_parser(subparsers) -> ArgumentParser` and `async run(args) -> int`.

    `only`: a service's name; then just its module is imported, so a service does not carry the others'
    libraries (the watcher idles at ~54 MiB alone, ~89 MiB with every command's imports)."""
    if only in registry.SERVICES:
        module = registry.command_module(only)
        if module is not None:
            return [module]
    from . import dev, events_command  # the dev stack imports every service

    return [events_command, dev, *registry.command_modules()]


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="env KAI_ISOLATOR_LOG_LEVEL (default info)")
    parser.add_argument("--log-json", action="store_const", const=True, help="JSON log lines (env KAI_ISOLATOR_LOG_JSON)")


def add_bus_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", help="NATS URL (env KAI_ISOLATOR_NATS_URL); unset: start an embedded nats-server")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole CLI; given the arguments about to be parsed and naming a service, that service's command alone."""
    first = argv[0] if argv else None
    parser = argparse.ArgumentParser(
        prog="kai-isolator",
        description="Enforce KAI-Scheduler GPU-sharing limits: webhook, node agent, libvgpu.so, and an event bus on NATS.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in command_modules(first):
        sub = module.add_parser(commands)
        add_common_flags(sub)
        add_bus_flags(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
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
