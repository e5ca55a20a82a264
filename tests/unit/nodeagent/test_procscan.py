"""Reading files through a process's root never follows a tenant's link out of it, and never blocks."""

from __future__ import annotations

import os
from pathlib import Path

from kai_isolator.services.nodeagent import procscan


def test_links_resolve_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "container"
    (root / "etc").mkdir(parents=True)
    (root / "real").write_text("inside\n")
    (tmp_path / "real").write_text("host secret\n")
    (root / "etc" / "absolute").symlink_to("/real")  # means <root>/real, not the host's /real
    (root / "etc" / "escape").symlink_to("../../../../real")
    (root / "etc" / "loop").symlink_to("loop")
    assert procscan.read_in_root(root, "/etc/absolute") == "inside\n"
    assert procscan.read_in_root(root, "/etc/escape") == "inside\n"
    assert procscan.read_in_root(root, "/etc/loop") is None
    assert procscan.read_in_root(root, "/etc/missing") is None


def test_fifos_and_directories_are_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    assert procscan.read_in_root(tmp_path, "/fifo") is None
    assert procscan.read_in_root(tmp_path, "/dir") is None


def test_own_process_is_visible() -> None:
    me = os.getpid()
    assert me in procscan.pids(Path("/proc"))
    maps = procscan.mapped_files(Path("/proc"), me)
    assert maps and any(m.path.endswith(".so") or ".so." in m.path for m in maps)
    env = procscan.environ(Path("/proc"), me)
    assert env is not None and env.get("PATH")
    assert procscan.mapped_files(Path("/proc"), 2**22 + 12345) is None
