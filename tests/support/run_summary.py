"""Tables the tests print after the run (the attacks as run, the control planes' start-up): rows are kept by section in
whichever process ran the test, and with pytest-xdist every worker's rows travel to the controller, which prints them."""

from __future__ import annotations

import json
from typing import Any

import pytest

_SECTIONS: dict[str, dict[str, Any]] = {}
"""section title -> {"header": a line above the rows or "", "rows": [lines]}, in the order sections were first used."""
_WORKER_KEY = "kai_isolator_summary"


def add(section: str, row: str, header: str = "") -> None:
    """One line of `section`'s table, printed after the tests (with `header` above the section's rows)."""
    table = _SECTIONS.setdefault(section, {"header": header, "rows": []})
    table["rows"].append(row)


def _merge(sections: dict[str, dict[str, Any]]) -> None:
    for section, table in sections.items():
        for row in table["rows"]:
            add(section, row, table["header"])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In an xdist worker: hand this worker's rows to the controller (xdist sends `workeroutput` when the worker ends)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_WORKER_KEY] = json.dumps(_SECTIONS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """In the xdist controller: a worker ended; keep its rows."""
    _merge(json.loads(getattr(node, "workeroutput", {}).get(_WORKER_KEY, "{}")))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for section, table in _SECTIONS.items():
        terminalreporter.section(section)
        if table["header"]:
            terminalreporter.write_line(table["header"])
        for row in sorted(table["rows"]):  # workers end in any order
            terminalreporter.write_line(row)
