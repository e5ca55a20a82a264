"""Install, upgrade, GC and uninstall of libvgpu.so in temp host roots, with real processes
that have the library mapped and keep allocating through it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kai_isolator.services.nodeagent import install
from kai_isolator.services.nodeagent.layout import HostLayout, version_of
from support.nodeagent import MIB, Libraries, namespaced_worker, preloaded_worker

PROC = Path("/proc")


def layout_of(root: Path) -> HostLayout:
    return HostLayout(root)


def test_first_install_lays_out_a_complete_directory(host_root: Path, libraries: Libraries) -> None:
    layout = layout_of(host_root)
    version = install.install(layout, libraries.v1)

    assert version == version_of(libraries.v1.read_bytes())
    assert sorted(os.listdir(layout.install_dir)) == ["ld.so.preload", "libvgpu.so", f"libvgpu.so.{version}"]
    assert os.readlink(layout.link) == f"libvgpu.so.{version}"  # relative: resolves inside containers too
    assert layout.preload.read_text() == "/usr/local/vgpu/libvgpu.so\n"
    assert layout.library(version).read_bytes() == libraries.v1.read_bytes()
    assert oct(layout.library(version).stat().st_mode & 0o777) == "0o644"
    state = install.status(layout)
    assert state.installed and state.active_version == version and state.problems == []


def test_first_install_into_a_mounted_directory_of_a_read_only_root(host_root: Path, libraries: Libraries, tmp_path: Path) -> None:
    """The DaemonSet's view: /host-root is the container's read-only root, the library and state directories hostPaths
    mounted on it, so nothing can be staged beside the library directory; the install goes into it, preload file last."""
    mounted, state = tmp_path / "hostpath", tmp_path / "state"
    mounted.mkdir()
    state.mkdir()
    (host_root / "usr/local/vgpu").mkdir(parents=True)
    (host_root / "var/lib/kai-isolator").mkdir(parents=True)
    script = (f"from kai_isolator.services.nodeagent import install; from kai_isolator.services.nodeagent.layout import HostLayout; "
              f"from pathlib import Path; print(install.install(HostLayout(Path({str(host_root)!r})), Path({str(libraries.v1)!r})))")
    root = str(host_root)
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && mount --bind "$2" "$1/usr/local/vgpu" && '
                           f'mount --bind "$3" "$1/var/lib/kai-isolator" && exec "$4" -c "$5"',
                           "sh", root, str(mounted), str(state), sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    version = done.stdout.strip()
    assert version == version_of(libraries.v1.read_bytes())
    assert sorted(os.listdir(mounted)) == ["ld.so.preload", "libvgpu.so", f"libvgpu.so.{version}"]
    assert (mounted / "ld.so.preload").read_text() == "/usr/local/vgpu/libvgpu.so\n"
    assert os.readlink(mounted / "libvgpu.so") == f"libvgpu.so.{version}"
    assert not [p for p in (host_root / "usr/local").iterdir() if p.name != "vgpu"]


def test_custom_mount_is_what_preload_names(host_root: Path, libraries: Libraries) -> None:
    layout = HostLayout(host_root, "/opt/vgpu")
    install.install(layout, libraries.v1)
    assert (host_root / "opt/vgpu/ld.so.preload").read_text() == "/opt/vgpu/libvgpu.so\n"


def test_reinstall_of_the_same_build_changes_nothing(host_root: Path, libraries: Libraries) -> None:
    layout = layout_of(host_root)
    version = install.install(layout, libraries.v1)
    inodes = {name: os.lstat(layout.install_dir / name).st_ino for name in os.listdir(layout.install_dir)}
    assert install.install(layout, libraries.v1) == version
    assert {name: os.lstat(layout.install_dir / name).st_ino for name in os.listdir(layout.install_dir)} == inodes


@pytest.mark.parametrize("content", [b"", b"#!/bin/sh\necho not a library\n", b"\x7fELF" + b"\x02\x01\x01" + b"\0" * 9 + b"\x02\x00" + b"\0" * 60])
def test_a_bad_library_is_refused_and_nothing_changes(host_root: Path, libraries: Libraries, tmp_path: Path, content: bytes) -> None:
    layout = layout_of(host_root)
    version = install.install(layout, libraries.v1)
    bad = tmp_path / "bad.so"
    bad.write_bytes(content)
    with pytest.raises(install.InstallError):
        install.install(layout, bad)
    assert install.active_version(layout) == version
    assert install.installed_versions(layout) == [version]


def test_install_into_an_existing_empty_directory(host_root: Path, libraries: Libraries) -> None:
    layout = layout_of(host_root)
    layout.install_dir.mkdir(parents=True)
    install.install(layout, libraries.v1)
    assert install.status(layout).installed


def test_kubelet_directory_in_place_of_ld_so_preload_is_repaired(host_root: Path, libraries: Libraries) -> None:
    layout = layout_of(host_root)
    layout.install_dir.mkdir(parents=True)
    (layout.install_dir / "something-else").write_text("x")  # not empty: no whole-directory rename
    layout.preload.mkdir()  # what kubelet does for a subPath that does not exist yet
    assert install.status(layout).preload == "directory"

    install.install(layout, libraries.v1)

    assert layout.preload.is_file() and layout.preload.read_text() == layout.preload_content
    assert install.status(layout).installed
    assert not [n for n in os.listdir(layout.install_dir) if "kubelet" in n]  # the empty directory is gone


def test_upgrade_keeps_running_processes_on_their_version(host_root: Path, libraries: Libraries) -> None:
    layout = layout_of(host_root)
    old = install.install(layout, libraries.v1)
    worker = preloaded_worker(layout.link, {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(host_root / "old.cache")})
    try:
        assert worker.alloc(256 * MIB) == 0
        assert worker.maps() == [str(layout.library(old))]

        new = install.install(layout, libraries.v2)
        assert new != old and install.active_version(layout) == new

        # The old process never crashes, still maps its own (unchanged) file, and still enforces its limit.
        assert worker.alloc(256 * MIB) == 0
        assert worker.alloc(1024 * MIB) == 2  # CUDA_ERROR_OUT_OF_MEMORY
        assert worker.maps() == [str(layout.library(old))]
        assert layout.library(old).read_bytes() == libraries.v1.read_bytes()

        fresh = preloaded_worker(layout.link)
        try:
            assert fresh.maps() == [str(layout.library(new))]
        finally:
            fresh.stop()

        # GC keeps the old version while the old process maps it ...
        removed, kept = install.collect_garbage(layout, PROC, grace_s=0)
        assert (removed, kept) == ([], [old])
        assert layout.library(old).exists()
    finally:
        worker.stop()
    # ... and removes it once that process has exited.
    removed, kept = install.collect_garbage(layout, PROC, grace_s=0)
    assert (removed, kept) == ([old], [])
    assert install.installed_versions(layout) == [new]


def test_gc_waits_out_the_grace_period(host_root: Path, libraries: Libraries) -> None:
    layout = layout_of(host_root)
    old = install.install(layout, libraries.v1)
    install.install(layout, libraries.v2)
    assert install.collect_garbage(layout, PROC, grace_s=3600) == ([], [old])
    assert install.collect_garbage(layout, PROC, grace_s=0) == ([old], [])


def test_uninstall_stops_preloading_first_and_keeps_what_is_in_use(host_root: Path, libraries: Libraries, tmp_path: Path) -> None:
    layout = layout_of(host_root)
    version = install.install(layout, libraries.v1)
    container = namespaced_worker(host_root, tmp_path / "ns")
    try:
        assert container.maps() == [f"/usr/local/vgpu/libvgpu.so.{version}"]
        steps: list[str] = []
        result = install.uninstall(layout, PROC, checkpoint=steps.append)
        assert steps[0] == "remove-preload"
        assert not layout.preload.exists()
        assert not result.complete and result.still_in_use == [version]
        # Its /etc/ld.so.preload (the bind-mounted old file) must not name a missing file.
        assert layout.link.exists() and layout.library(version).exists()
        assert container.alloc(MIB) == 0
    finally:
        container.stop()
    result = install.uninstall(layout, PROC)
    assert result.complete and result.removed == [version]
    assert not layout.install_dir.exists()


def test_uninstall_of_nothing_is_complete(host_root: Path) -> None:
    assert install.uninstall(layout_of(host_root), PROC).complete


CRASH_POINTS_FIRST = ["stage-directory", "rename-directory", "done"]
CRASH_POINTS_UPGRADE = ["write-library", "rename-library", "write-link", "rename-link", "write-preload", "rename-preload", "done"]

_CRASHER = """
import os, sys
from pathlib import Path
from kai_isolator.services.nodeagent import install
from kai_isolator.services.nodeagent.layout import HostLayout
root, library, step = sys.argv[1:4]
def checkpoint(name):
    if name == step:
        os.kill(os.getpid(), 9)
install.install(HostLayout(Path(root)), Path(library), checkpoint=checkpoint)
"""


def crash_install(root: Path, library: Path, step: str) -> int:
    return subprocess.run([sys.executable, "-c", _CRASHER, str(root), str(library), step], check=False).returncode


def assert_all_or_nothing(layout: HostLayout, scratch: Path) -> None:
    """Whatever a container would see now: a complete library preloaded, or no preload at all."""
    if layout.preload.exists():
        assert layout.preload.read_text() == layout.preload_content
        target = layout.link.resolve(strict=True)
        assert version_of(target.read_bytes()) == target.name.rsplit(".", 1)[1]
    container = namespaced_worker(layout.host_root, scratch)
    try:
        maps = container.maps()
        assert container.alloc(MIB) == 0
    finally:
        container.stop()
    assert maps == ([f"/usr/local/vgpu/{layout.link.resolve().name}"] if layout.preload.exists() else [])


@pytest.mark.parametrize("step", CRASH_POINTS_FIRST)
def test_killed_during_first_install(host_root: Path, libraries: Libraries, tmp_path: Path, step: str) -> None:
    layout = layout_of(host_root)
    assert crash_install(host_root, libraries.v1, step) == -9
    assert_all_or_nothing(layout, tmp_path / "ns1")
    assert install.install(layout, libraries.v1)  # a rerun finishes the job and cleans up
    assert install.status(layout).installed
    assert not [p for p in layout.install_dir.parent.iterdir() if p.name.startswith(".")]
    assert_all_or_nothing(layout, tmp_path / "ns2")


@pytest.mark.parametrize("step", CRASH_POINTS_UPGRADE)
def test_killed_during_upgrade(host_root: Path, libraries: Libraries, tmp_path: Path, step: str) -> None:
    layout = layout_of(host_root)
    old = install.install(layout, libraries.v1)
    layout.preload.unlink() if step in ("write-preload", "rename-preload") else None  # make the preload step happen
    assert crash_install(host_root, libraries.v2, step) == -9
    assert install.active_version(layout) in (old, version_of(libraries.v2.read_bytes()))
    assert_all_or_nothing(layout, tmp_path / "ns1")
    new = install.install(layout, libraries.v2)
    assert install.status(layout).installed and install.active_version(layout) == new
    assert not [n for n in os.listdir(layout.install_dir) if n.startswith(".")]
