"""`python -m kai_isolator.services.watcher`: the watcher alone, without loading every other service's command module."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kai_isolator.shared import logs
from kai_isolator.shared.errors import IsolatorError
from kai_isolator.shared.settings import LogSettings, load

from . import command


def main() -> None:
    parser = argparse.ArgumentParser(prog="kai-isolator-watcher")
    commands = parser.add_subparsers(dest="command")
    sub = command.add_parser(commands)
    sub.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    sub.add_argument("--log-json", action="store_const", const=True)
    sub.add_argument("--nats-url")
    args = parser.parse_args(["watcher", *sys.argv[1:]])
    try:
        logs.configure(load(LogSettings, args))
        code = asyncio.run(command.run(args))
    except IsolatorError as error:
        print(f"kai-isolator watcher: {error}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
