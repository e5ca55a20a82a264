"""The event contract's foreign tools, built once per run by `make -C docs/events tools` (a no-op when up to date)."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from support import REPO

EVENTS = REPO / "docs" / "events"
SCHEMAS = EVENTS / "schemas"


@dataclass(frozen=True)
class ContractTools:
    validate_asyncapi: list[str]
    node_subscriber: list[str]
    go_subscriber: list[str]


@functools.cache
def contract_tools() -> ContractTools:
    """`make test` builds these first; a bare pytest run builds them here (npm ci, tsc, go build)."""
    built = subprocess.run(["make", "--no-print-directory", "-C", str(EVENTS), "tools"], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        raise RuntimeError(f"building docs/events tools failed (needs node, npm and go):\n{built.stdout}{built.stderr}")
    return ContractTools(
        validate_asyncapi=["node", str(EVENTS / "validate" / "validate.mjs")],
        node_subscriber=["node", str(EVENTS / "examples" / "node" / "dist" / "subscriber.js")],
        go_subscriber=[str(EVENTS / "examples" / "go" / "bin" / "verdict-subscriber")],
    )
