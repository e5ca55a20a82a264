"""A service started through `kai-isolator SERVICE` imports that service alone, not every other's libraries."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from kai_isolator.services import cli
cli.build_parser(sys.argv[1:])
print(",".join(sorted(m for m in sys.modules if m.startswith(("kubernetes_asyncio", "kai_isolator.services.")) and m.count(".") <= 3)))
"""


def imported(*argv: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60, check=True)
    return set(done.stdout.strip().split(","))


def test_the_watcher_command_loads_no_other_service_nor_kubernetes_asyncio() -> None:
    modules = imported("watcher")
    assert "kai_isolator.services.watcher.command" in modules
    assert not {m for m in modules if m.startswith("kubernetes_asyncio")}
    others = {m.split(".")[2] for m in modules if m.startswith("kai_isolator.services.") and m.count(".") >= 2}
    assert others <= {"watcher", "cli", "registry"}, others


def test_any_other_first_argument_gets_the_whole_command_line() -> None:
    modules = imported("events")
    assert {"kai_isolator.services.verifier.command", "kai_isolator.services.dev"} <= modules
