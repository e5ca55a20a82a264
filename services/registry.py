"""Finds each service's CLI command (`<service>/command.py`) and dev component (`<service>/dev.py`).

By convention rather than by import lines, so a service appears exactly when its module
exists and no shared file has to change when one lands.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

# Order of `--help` and of start-up in `kai-isolator dev`: later ones use what earlier ones publish
# (the devcluster registers the webhook the admission component started).
SERVICES = ("admission", "devcluster", "certs", "watcher", "nodeagent", "installer", "verifier")


def _modules(leaf: str) -> list[ModuleType]:
    found = []
    for service in SERVICES:
        name = f"{__package__}.{service}.{leaf}"
        try:
            present = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the service package itself is absent
            present = False
        if present:
            found.append(importlib.import_module(name))
    return found


def command_module(service: str) -> ModuleType | None:
    """One service's command module alone, or None when it has none."""
    name = f"{__package__}.{service}.command"
    return importlib.import_module(name) if importlib.util.find_spec(name) is not None else None


def command_modules() -> list[ModuleType]:
    """Modules with `add_parser(subparsers) -> ArgumentParser` and `async run(args) -> int`."""
    return _modules("command")


def dev_components() -> list[Any]:
    """Each service's `component(ctx)` async context manager factory for `kai-isolator dev`."""
    return [module.component for module in _modules("dev")]
