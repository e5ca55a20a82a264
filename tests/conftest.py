"""Fixtures every test may use: a real nats-server per test and fast bus settings; the run's options and its grouping
of tests into pytest-xdist workers. What the folders share besides lives in support/ (docs/development.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.settings import BusSettings
from support import REPO
from support.bus import RuntimeFactory

# The tables printed after the run; node agent fixtures (`libraries`, `start_agent`), which serve the node agent and
# installer tests alike; the real control plane (`control_plane`, `deployed`), started only for the tests that ask.
pytest_plugins = ["support.run_summary", "support.nodeagent", "support.control_plane"]

SHARED_ONCE = {"real_node_session": "real-node", "kai_plane": "kai-plane"}
"""Session fixtures worth starting once per run, not once per pytest-xdist worker: their tests share one worker."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fail-on-skip", action="store_true",
                     help="a skipped test fails, naming what it lacked (make test: it installs all its tests need, so "
                          "a skip would hide a missing install step)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail") and item.config.getoption("fail_on_skip"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped under make test, which installs and starts everything its tests need: {reason}\n"
                           "install what it names (hack/host-setup lists the Debian packages make test installs)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (`make test` runs with --dist loadgroup)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = _worker_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A group xdist did not take would split a module's fixture across workers (two compose stacks of one name)."""
    if item.config.getoption("loadgroup", False) and item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
        pytest.fail("pytest-xdist did not keep this test in its group: is pytest newer than pyproject.toml allows?")


def _worker_group(item: pytest.Item) -> str | None:
    """The tests that must run in one worker: those of a costly session fixture, and those of one module where they
    share a module-scoped fixture (a compose stack, a chart on the real node: set up once, not once per worker). No test
    relies on the order they run in: each passes alone (`pytest path::test`)."""
    names = set(getattr(item, "fixturenames", ()))
    for fixture, group in SHARED_ONCE.items():
        if fixture in names:
            return group
    definitions = getattr(item, "_fixtureinfo", None)
    scopes = {d.scope for defs in (definitions.name2fixturedefs.values() if definitions else ()) for d in defs}
    if scopes & {"module", "package", "class"}:
        return str(item.path.relative_to(REPO))
    return None


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream in this test's temp dir (about 15 ms to start)."""
    server = EmbeddedNats(tmp_path / "jetstream")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def bus_settings(nats_server: EmbeddedNats) -> BusSettings:
    """Short delays so retry paths run in test time."""
    return BusSettings(
        nats_url=nats_server.url, max_deliver=3, backoff_base_s=0.05, backoff_max_s=0.4,
        ack_wait_s=2.0, nats_connect_timeout_s=5.0,
    )


@pytest.fixture
async def start_runtime(bus_settings: BusSettings) -> AsyncIterator[RuntimeFactory]:
    """Start runtimes with handlers bound by `setup(runtime)`; all are stopped at teardown."""
    started: list[Runtime] = []

    async def factory(service: str, setup: Callable[[Runtime], None] = lambda r: None, **kwargs: object) -> Runtime:
        runtime = Runtime(service, kwargs.pop("settings", bus_settings), **kwargs)  # type: ignore[arg-type]
        setup(runtime)
        await runtime.start(runtime.settings.nats_url or "")
        started.append(runtime)
        return runtime

    yield factory
    for runtime in reversed(started):
        await runtime.stop()
