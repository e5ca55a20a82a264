"""Runs the hami-core C test programs under LD_PRELOAD against the fake driver and
parses their `key=value` output lines."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu

REPO = Path(__file__).resolve().parents[3]
HAMI = REPO / "hami-core"
BUILD = HAMI / "build"
LIBVGPU = BUILD / "libvgpu.so"
FAKE_DIR = BUILD / "fake"
TESTS_DIR = BUILD / "tests"
MIB = 1 << 20
GIB_BYTES = 1 << 30
_CACHE_DIR = tempfile.TemporaryDirectory(prefix="vgpu-cache-")
_cache_ids = itertools.count()

# Variables that would change what the library or the fake does; never inherited.
_CONTROLLED = re.compile(r"^(CUDA_|LIBCUDA_|FAKE_CUDA_|LD_PRELOAD$|LD_LIBRARY_PATH$|NVIDIA_)")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()

    def fields(self, prefix: str, nth: int = 0) -> dict[str, str]:
        """key=value pairs of the nth output line starting with `prefix`."""
        matches = [line for line in self.lines if line.split(" ", 1)[0] == prefix]
        assert len(matches) > nth, f"no line #{nth} starting with {prefix!r} in:\n{self.stdout}"
        return dict(re.findall(r"(\w+)=(\S+)", matches[nth]))

    def rcs(self, prefix: str) -> list[int]:
        return [int(f["rc"]) for f in self.all_fields(prefix)]

    def all_fields(self, prefix: str) -> list[dict[str, str]]:
        return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in self.lines if line.split(" ", 1)[0] == prefix]


def base_env(extra: dict[str, str] | None = None, preload: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _CONTROLLED.match(k)}
    env["LD_LIBRARY_PATH"] = str(FAKE_DIR)
    # Each run gets its own shared accounting file unless the test shares one on purpose.
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = fresh_cache_path()
    if preload:
        env["LD_PRELOAD"] = str(LIBVGPU)
    env.update(extra or {})
    return env


@contextlib.contextmanager
def node_gpu(folder: Path, devices: int = 1, total_mib: int = 15360) -> Iterator[dict[str, str]]:
    """A node-wide fake GPU: the fake-gpu ledger beside a copy of the fake libraries in `folder`.
    Yields the environment that reaches it (the library path; the ledger needs nothing else)."""
    with FakeGpu(folder, devices=devices, total_mib=total_mib) as gpu:
        yield {"LD_LIBRARY_PATH": str(gpu.folder)}


def fresh_cache_path() -> str:
    return os.path.join(_CACHE_DIR.name, f"usage-{os.getpid()}-{next(_cache_ids)}.cache")


def run_program(argv: list[str], env: dict[str, str] | None = None, preload: bool = True,
                timeout: float = 60, wrapper: list[str] | None = None) -> Result:
    proc = subprocess.run((wrapper or []) + argv, env=base_env(env, preload), capture_output=True,
                          text=True, timeout=timeout, check=False)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def probe(*commands: str, env: dict[str, str] | None = None, path: str = "link", preload: bool = True,
          ptds: bool = False, device: int | None = 0, check: bool = True,
          wrapper: list[str] | None = None, timeout: float = 60) -> Result:
    """Runs build/tests/cuprobe; unless device is None it first makes that device's context current."""
    argv = [str(TESTS_DIR / "cuprobe"), f"--path={path}"] + (["--ptds"] if ptds else [])
    setup = ["init", "ctx", str(device)] if device is not None else []
    result = run_program(argv + setup + list(commands), env, preload, timeout, wrapper)
    if check:
        assert result.returncode == 0, result.stderr
    return result
