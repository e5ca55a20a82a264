"""The build cache's lock: builders take turns, and a lock another process never releases ends the wait with a clear
error after its bound, not a hang."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kai_isolator.services.devcluster import build

HOLD = "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"


def test_a_lock_held_by_another_process_ends_the_wait_with_an_error(tmp_path: Path) -> None:
    path = tmp_path / "entry.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        started = time.monotonic()
        with pytest.raises(build.BuildError, match="held .*entry.lock for over 1 s"):
            with build.locked(path, timeout_s=1.0):
                pytest.fail("took a lock another process holds")
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_free_again_once_its_holder_is_done(tmp_path: Path) -> None:
    path = tmp_path / "entry.lock"
    with build.locked(path, timeout_s=1.0):
        pass
    with build.locked(path, timeout_s=1.0):
        assert path.exists()
