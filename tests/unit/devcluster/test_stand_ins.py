"""The GPU's stand-ins live with the other fakes (services/devcluster/), apart from the code that ships: shared/, which
every service imports, holds none, and no command a production image runs imports the fake driver's ledger."""

from __future__ import annotations

import json
import subprocess
import sys

from support import REPO

LEDGER = "kai_isolator.services.devcluster.fake_gpu_ledger"
STAND_INS = (LEDGER, "kai_isolator.services.devcluster.fakegpu", "kai_isolator.services.devcluster.nvidia_runtime")
# What the images run: each service's command as `kai-isolator <service>` loads it (cli.command_modules: the one
# service's module alone), the modules those commands start, and the kubectl plugin users install.
PRODUCTION_COMMANDS = ("admission", "certs", "watcher", "nodeagent", "installer", "verifier")
PRODUCTION_MODULES = (
    "kai_isolator.services.cli", "kai_isolator.services.admission.server", "kai_isolator.services.watcher.service",
    "kai_isolator.services.verifier.service", "kai_isolator.services.installer.rollout", "kai_isolator.services.nodeagent.agent",
    "kai_isolator.services.kubectl_plugin.cli",
)
# In a fresh interpreter: this test process has long imported the ledger (the suite's fixtures use it).
LOADED = f"""
import importlib, json, sys
from kai_isolator.services import cli
for command in {PRODUCTION_COMMANDS!r}:
    cli.build_parser([command])
for module in {PRODUCTION_MODULES!r}:
    importlib.import_module(module)
print(json.dumps(sorted(name for name in sys.modules if name.startswith("kai_isolator."))))
"""


def test_no_production_command_imports_a_stand_in() -> None:
    done = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert "kai_isolator.services.nodeagent.command" in loaded and "kai_isolator.services.admission.command" in loaded, loaded
    assert not [name for name in loaded if name in STAND_INS], loaded


def test_the_dev_stack_still_brings_the_ledger_up() -> None:
    """`make run` (`kai-isolator dev`) starts a fake GPU beside its node agent: the dev component imports the ledger."""
    from kai_isolator.services.nodeagent import dev

    assert dev.FakeGpu.__module__ == LEDGER


def test_shared_holds_no_stand_in() -> None:
    """A stand-in says what it is (`A DEV AND TEST FIXTURE`, a fake): none of shared/'s modules does."""
    shared = sorted((REPO / "shared").glob("*.py"))
    assert shared, "no shared/ modules found"
    stand_ins = [path.name for path in shared if "fake" in path.stem or "TEST FIXTURE" in path.read_text().upper()]
    assert stand_ins == [], f"stand-ins in shared/, which every service imports and every image ships: {stand_ins}"
