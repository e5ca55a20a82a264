"""`kai-isolator events`: print the isolation event stream, live or replayed from a point in time."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import datetime

from kai_isolator.shared import subjects
from kai_isolator.shared.bus import stop_signals
from kai_isolator.shared.embedded_nats import bus_url
from kai_isolator.shared.event_contract import event_schema
from kai_isolator.shared.settings import BusSettings, load
from kai_isolator.shared.tail import follow, parse_since, render_line
from kai_isolator.shared.tasks import cancel_all


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("events", help="tail the isolation event stream", description=__doc__)
    parser.add_argument("--subject", default=subjects.ALL_EVENTS, help="subject filter, e.g. 'isolator.pod.>' (default: all events)")
    parser.add_argument("--since", help="replay from this long ago (10m, 2h, 1d) or an ISO time, then follow")
    parser.add_argument("--json", action="store_true", help="print each CloudEvent as one JSON line")
    parser.add_argument("--limit", type=int, help="exit after this many events")
    parser.add_argument("--schema", metavar="TYPE", help="print the JSON Schema of a CloudEvents type (e.g. io.kai-isolator.health.verdict.v1) and exit")
    return parser


async def run(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(event_schema(args.schema), indent=2, ensure_ascii=False))
        return 0
    since = parse_since(args.since) if args.since else None
    settings = load(BusSettings, args)
    async with bus_url(settings) as url:
        with stop_signals() as stop:
            printer = asyncio.create_task(_print(url, settings, args.subject, since, args.json, args.limit))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({printer, stopper}, return_when=asyncio.FIRST_COMPLETED)
            await cancel_all([printer, stopper])  # a cancel landing in the NATS client can be swallowed: ask again
    return 0


async def _print(url: str, settings: BusSettings, subject: str, since: datetime | None, as_json: bool, limit: int | None) -> None:
    seen = 0
    async for item in follow(url, subject, since, settings):
        print(render_line(item, as_json), flush=True)
        seen += 1
        if limit is not None and seen >= limit:
            return
    sys.stdout.flush()
