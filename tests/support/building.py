"""Builds the tests need, done once before any test runs (outside every test's timeout), whichever worker asks first."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import pytest

from kai_isolator.services.devcluster.build import cache_root, locked

Built = TypeVar("Built")


def build_before_tests(config: pytest.Config, items: list[pytest.Item], fixtures: set[str], build: Callable[[], Built],
                       failure: type[Exception] | tuple[type[Exception], ...]) -> Built | Exception | None:
    """Build what tests using `fixtures` need once, before any runs: outside every test's timeout, progress on the terminal.

    A build failure is returned, not raised: the tests that need it fail with it, the rest of the suite still runs.
    """
    if not any(fixtures & set(getattr(item, "fixturenames", ())) for item in items):
        return None
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        try:
            # Every xdist worker builds what its tests need: the first builds, the others wait and find the cache warm
            # (concurrent mmdebstrap runs or image builds of one tag would race).
            with locked(cache_root() / "test-builds.lock"):
                return build()
        except failure as error:
            return error
