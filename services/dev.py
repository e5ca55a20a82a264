"""`kai-isolator dev`: the embedded bus plus every service, in one process tree, until Ctrl-C.

Each service contributes a component (`component` in its `dev.py`): an async context
manager factory that starts it in-process against the shared `DevContext` and stops it on
exit. Components start in `registry.SERVICES` order and stop in reverse.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import tempfile
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kai_isolator.shared.bus import connect, provision_stream, stop_signals
from kai_isolator.shared.tasks import cancel_all
from kai_isolator.shared.embedded_nats import bus_url
from kai_isolator.shared.settings import BusSettings, load
from kai_isolator.shared.tail import follow, render_line

from . import registry
from .demo.scenario import run_demo

log = logging.getLogger(__name__)


@dataclass
class DevContext:
    """What components share: the bus, a private work dir, and values earlier components publish."""

    nats_url: str
    bus: BusSettings
    workdir: Path
    values: dict[str, Any] = field(default_factory=dict)
    nats_embedded: bool = False

    @property
    def nats_description(self) -> str:
        """Which NATS the services use, for banners: never claim an embedded one that is not."""
        return f"an embedded NATS at {self.nats_url}" if self.nats_embedded else f"the NATS at {self.nats_url}"


DevComponent = Callable[[DevContext], AbstractAsyncContextManager[None]]



def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("dev", help="run the bus and all services locally, printing events", description=__doc__)
    parser.add_argument("--demo", action="store_true", help="walk through the isolation flow on the local kube-apiserver, print the timeline, exit")
    return parser


async def run(args: argparse.Namespace) -> int:
    settings = load(BusSettings, args)
    if args.demo and args.log_level is None:
        logging.getLogger().setLevel(logging.WARNING)  # the timeline is the demo's output, from the start
    async with bus_url(settings) as url, contextlib.AsyncExitStack() as stack:
        await _provision(url, settings)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kai-isolator-dev-")))
        context = DevContext(nats_url=url, bus=settings.model_copy(update={"nats_url": url}), workdir=workdir,
                             nats_embedded=settings.nats_url is None)
        # Later components may rely on values earlier ones put in DevContext.values.
        for component in registry.dev_components():
            await stack.enter_async_context(component(context))
        if args.demo:
            return await run_demo(context)
        with stop_signals() as stop:
            timeline = asyncio.create_task(_print_events(url, context.bus))
            print(f"kai-isolator dev: bus is {context.nats_description}; printing events; Ctrl-C to stop", flush=True)
            await stop.wait()
        await cancel_all([timeline])  # a cancel landing in the NATS client's reconnect can be swallowed: ask again
    print("kai-isolator dev: stopped", flush=True)
    return 0


async def _provision(url: str, settings: BusSettings) -> None:
    nc = await connect(settings, url, "kai-isolator-dev")
    try:
        await provision_stream(nc.jetstream(timeout=settings.jetstream_timeout_s), settings)
    finally:
        await nc.drain()


async def _print_events(url: str, settings: BusSettings) -> None:
    async for item in follow(url, settings=settings):
        print(render_line(item, as_json=False), flush=True)
