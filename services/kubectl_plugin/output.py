"""kubectl's output conventions: aligned columns under upper-case headers, `-o wide|json|yaml`, ages like
`5m`, colour only on a terminal (and never with NO_COLOR)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TextIO

import yaml

_COLOURS = {"breached": "31", "missing": "31", "degraded": "33", "verified": "32", "failed": "31", "stale": "31", "not-ready": "31"}


def age(since: datetime | None, now: datetime) -> str:
    """kubectl's short ages: 42s, 7m, 3h, 5d."""
    if since is None:
        return "<none>"
    seconds = max(0, int((now - since).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * (2 if unit != "m" else 1):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def mib(size: int | None) -> str:
    return "<none>" if size is None else f"{size >> 20}Mi"


def use_colour(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def paint(text: str, colour: bool) -> str:
    code = _COLOURS.get(text)
    return f"\x1b[{code}m{text}\x1b[0m" if colour and code else text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], stream: TextIO, *, colour_column: int | None = None) -> None:
    """Columns padded to the widest cell plus three spaces, as kubectl's tabwriter does; colour never shifts them."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    colour = use_colour(stream)

    def line(cells: Sequence[str], painted: bool) -> str:
        out = []
        for i, cell in enumerate(cells):
            shown = paint(cell, colour) if painted and i == colour_column else cell
            out.append(shown + " " * (widths[i] - len(cell)) if i < len(cells) - 1 else shown)
        return "   ".join(out).rstrip()

    stream.write(line(headers, False) + "\n")
    for row in rows:
        stream.write(line(row, True) + "\n")


def dump(document: Any, form: str, stream: TextIO = sys.stdout) -> None:
    if form == "json":
        stream.write(json.dumps(document, indent=4) + "\n")
    else:
        stream.write(yaml.safe_dump(document, sort_keys=False))
