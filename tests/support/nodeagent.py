"""The node agent's harness: hami-core's build (and two content-addressed copies of the library), worker processes
(plain, or in a private mount namespace that sees a temp host root's /usr/local/vgpu and /etc/ld.so.preload, never this
machine's own) that allocate through libvgpu.so on command, and the fixtures of the node agent and installer tests
(`libraries`, `start_agent`, `kubelet_cgroups`; registered from tests/conftest.py)."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kai_isolator.services.demo.kubelet import CgroupPlacement, cgroup_hierarchies
from kai_isolator.services.nodeagent.agent import NodeAgent
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.shared.settings import BusSettings
from support import REPO

HAMI = REPO / "hami-core"
LIBVGPU = HAMI / "build" / "libvgpu.so"
FAKE_DIR = HAMI / "build" / "fake"
MIB = 1 << 20

WORKER = textwrap.dedent("""
    import ctypes, sys
    cuda = None
    def setup():
        global cuda
        cuda = ctypes.CDLL("libcuda.so.1")
        ctx = ctypes.c_void_p()
        assert cuda.cuInit(0) == 0
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert cuda.cuCtxSetCurrent(ctx) == 0
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "alloc":
            if cuda is None:
                setup()
            ptr = ctypes.c_uint64()
            print("rc", cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(args[0]))), flush=True)
        elif cmd == "maps":
            paths = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libvgpu" in l})
            print("maps", " ".join(paths) or "-", flush=True)
        elif cmd == "ping":
            print("pong", flush=True)
""")


@dataclass(frozen=True)
class Libraries:
    v1: Path
    v2: Path


def make_libraries(directory: Path) -> Libraries:
    """Two builds with different content addresses (the second has bytes appended, which ld.so ignores)."""
    v1, v2 = directory / "v1" / "libvgpu.so", directory / "v2" / "libvgpu.so"
    v1.parent.mkdir()
    v2.parent.mkdir()
    shutil.copyfile(LIBVGPU, v1)
    v2.write_bytes(LIBVGPU.read_bytes() + b"\0kai-isolator test build 2\0")
    return Libraries(v1, v2)


# Each worker accounts in its own file unless a test shares one on purpose: the library's default
# path (/tmp/cudevshr.cache) is machine-wide, so another run's file must never decide a test.
_CACHES = tempfile.TemporaryDirectory(prefix="nodeagent-test-caches-")


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LD_", "FAKE_CUDA", "POD_UID", "CONTAINER_"))}
    env["LD_LIBRARY_PATH"] = str(FAKE_DIR)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(Path(_CACHES.name) / f"{uuid.uuid4().hex}.cache")
    env.update(extra or {})
    return env


class Worker:
    """A long-running process that allocates when told to; the caller kills it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.ask("ping")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, command: str, timeout_s: float = 60.0) -> str:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"worker did not answer {command!r}: {self.proc.stderr.read() if self.proc.stderr else ''}")
        return line.strip()

    def alloc(self, size: int) -> int:
        return int(self.ask(f"alloc {size}").split()[1])

    def maps(self) -> list[str]:
        return [p for p in self.ask("maps").split()[1:] if p != "-"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


def preloaded_worker(library: Path, env: dict[str, str] | None = None) -> Worker:
    """A host process with `LD_PRELOAD=<library>` (e.g. a host root's libvgpu.so link)."""
    return Worker([sys.executable, "-c", WORKER], worker_env({"LD_PRELOAD": str(library), **(env or {})}))


def namespaced_argv(host_root: Path, mount: str, argv: list[str], scratch: Path) -> list[str]:
    """`argv` in a private mount namespace where `mount` is host_root's install dir and
    /etc/ld.so.preload is its ld.so.preload (bind-mounted read-only, as kubelet's subPath does).
    Overlays keep every change inside the namespace."""
    parent = os.path.dirname(mount)
    etc_upper, etc_work = scratch / "etc-up", scratch / "etc-work"
    par_upper, par_work = scratch / "parent-up", scratch / "parent-work"
    for d in (etc_upper, etc_work, par_upper, par_work):
        d.mkdir(parents=True, exist_ok=True)
    (etc_upper / "ld.so.preload").touch()
    (par_upper / os.path.basename(mount)).mkdir(exist_ok=True)
    install_dir = host_root / mount.lstrip("/")
    script = " && ".join([
        f"mount -t overlay overlay -o lowerdir={parent},upperdir={par_upper},workdir={par_work} {parent}",
        f"if [ -d {install_dir} ]; then mount --bind {install_dir} {mount}; fi",
        f"mount -t overlay overlay -o lowerdir=/etc,upperdir={etc_upper},workdir={etc_work} /etc",
        f"if [ -f {install_dir}/ld.so.preload ]; then mount --bind -o ro {install_dir}/ld.so.preload /etc/ld.so.preload; fi",
        'exec "$@"',
    ])
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def namespaced_worker(host_root: Path, scratch: Path, env: dict[str, str] | None = None, mount: str = "/usr/local/vgpu") -> Worker:
    return Worker(namespaced_argv(host_root, mount, [sys.executable, "-c", WORKER], scratch), worker_env(env))


def build_hami() -> None:
    """hami-core's library, fake driver and probes built (`make -C hami-core`, a no-op when up to date)."""
    proc = subprocess.run(["make", "-s", "-C", str(HAMI)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- fixtures ------------------------------------------------------------------------------------------------------

AgentFactory = Callable[..., Awaitable[NodeAgent]]


@pytest.fixture(scope="session")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> Libraries:
    build_hami()
    return make_libraries(tmp_path_factory.mktemp("libraries"))


@pytest.fixture
async def start_agent(bus_settings: BusSettings, tmp_path: Path, libraries: Libraries) -> AsyncIterator[AgentFactory]:
    """Start agents named `node` on their own temp host roots (long periods: tests drive refreshes)."""
    started: list[NodeAgent] = []

    async def factory(node: str, **overrides: object) -> NodeAgent:
        root = tmp_path / f"host-{node}"
        root.mkdir(exist_ok=True)
        fields = {"node_name": node, "host_root": root, "library": [libraries.v1, libraries.v2], "gc_grace_s": 0,
                  "status_interval_s": 3600, "usage_interval_s": 3600, **overrides}
        agent = NodeAgent(NodeAgentSettings(**fields), bus_settings, probe_listen="127.0.0.1:0")
        await agent.start(bus_settings.nats_url or "")
        started.append(agent)
        return agent

    yield factory
    for agent in reversed(started):
        await agent.stop()


@pytest.fixture
def kubelet_cgroups() -> Iterator[CgroupPlacement]:
    """Kubelet-named cgroups under a prefix unique to this test (the agent finds containers by them)."""
    if os.geteuid() != 0 or not cgroup_hierarchies():
        pytest.skip("placing processes in kubelet-named cgroups needs root and a writable cgroup hierarchy")
    placement = CgroupPlacement()
    yield placement
    placement.remove()
