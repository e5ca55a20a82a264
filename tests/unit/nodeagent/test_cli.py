"""The one-shot operator forms: `kai-isolator nodeagent install|status|uninstall`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.nodeagent import Libraries, preloaded_worker


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kai_isolator.services.cli", "nodeagent", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_install_status_uninstall(host_root: Path, libraries: Libraries) -> None:
    assert cli("status", "--host-root", str(host_root)).returncode == 1  # nothing installed yet

    done = cli("install", "--host-root", str(host_root), "--library", str(libraries.v1), "--container-vgpu-mount", "/usr/local/vgpu")
    assert done.returncode == 0, done.stderr
    state = json.loads(cli("status", "--host-root", str(host_root), "--json").stdout)
    assert state["installed"] and state["preload"] == "ok" and state["installed_versions"] == [state["active_version"]]
    assert "active:" in cli("status", "--host-root", str(host_root)).stdout

    worker = preloaded_worker(host_root / "usr/local/vgpu/libvgpu.so")
    try:
        pending = cli("uninstall", "--host-root", str(host_root))
        assert pending.returncode == 3 and state["active_version"] in pending.stderr
    finally:
        worker.stop()
    assert cli("uninstall", "--host-root", str(host_root)).returncode == 0
    assert not (host_root / "usr/local/vgpu").exists()


def test_bad_input_gets_a_clear_error(host_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "not-a-library.so"
    script.write_text("#!/bin/sh\n")
    bad = cli("install", "--host-root", str(host_root), "--library", str(script))
    assert bad.returncode == 2 and "not an ELF file" in bad.stderr and "Traceback" not in bad.stderr
    missing = cli("install", "--host-root", str(host_root), "--library", str(tmp_path / "nope.so"))
    assert missing.returncode == 2 and "cannot read library" in missing.stderr
    relative = cli("install", "--host-root", str(host_root), "--library", str(script), "--container-vgpu-mount", "usr/vgpu")
    assert relative.returncode == 2 and "container-vgpu-mount" in relative.stderr
    assert not (host_root / "usr").exists()
