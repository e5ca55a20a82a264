"""Programs in cgroup v2 leaves against a node's fake GPU, for the tests of NVML 13.4's per-cgroup memory limits
(tests/unit/devcluster/test_fake_gpu_ledger_limits.py, tests/security/test_fake_driver.py).

The leaves are real: made by the test under the cgroup v2 hierarchy the kernel has mounted (on this cgroup v1
machine /sys/fs/cgroup/unified, where root may place processes without enabling any controller; /sys/fs/cgroup
on a v2 host) and removed after it. A program is placed in its leaf by the kernel's own interface (its pid
written to cgroup.procs by a shell that then execs it), so the ledger finds it there as it would a container's.
The program is hami-core's `cgmem`, linked to the fake driver by soname as an application is."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kai_isolator.services.devcluster.fake_gpu_ledger import Cgroups, FakeGpu
from support import REPO

CGMEM = REPO / "hami-core" / "build" / "tests" / "cgmem"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
OWN_USER_NAMESPACE = [*NOBODY, "unshare", "-Ur", "--"]  # "root" in a namespace of its own: a container's root
PLACE = 'echo $$ > "$0/cgroup.procs" && exec "$@"'  # the shell joins the leaf, then becomes the program

Step = tuple[str, dict[str, int | str]]


@contextlib.contextmanager
def readable_gpu(**options: int) -> Iterator[FakeGpu]:
    """A node's fake GPU (FakeGpu's options) in a folder every uid can read, as a node's driver folder is."""
    top = Path(tempfile.mkdtemp(prefix="kai-fake-driver-", dir="/tmp"))
    top.chmod(0o755)
    try:
        with FakeGpu(top / "driver", **options) as started:  # type: ignore[arg-type]
            yield started
    finally:
        shutil.rmtree(top, ignore_errors=True)


def v2_mount() -> Path | None:
    """Where the whole cgroup v2 hierarchy is mounted, if root can make cgroups in it."""
    for root, point in Cgroups().mounts:
        if root == "/" and os.access(point, os.W_OK):
            return Path(point)
    return None


def v1_directory() -> Path | None:
    """A cgroup v1 hierarchy's directory, where this machine has one."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] == "cgroup":
            return Path(fields[4])
    return None


def make_tree(top: Path, *leaves: str) -> Path:
    """A cgroup of the test's own under the v2 hierarchy, with the given descendants."""
    top.mkdir()
    for leaf in leaves:
        (top / leaf).mkdir(parents=True, exist_ok=True)
    return top


def remove_tree(top: Path) -> None:
    """Every cgroup under `top`, deepest first (a cgroup goes only once it has no children and no processes)."""
    for folder, _, _ in sorted(os.walk(top), key=lambda entry: entry[0].count("/"), reverse=True):
        os.rmdir(folder)


def unique_top(mount: Path) -> Path:
    return mount / f"kai-fake-gpu-test-{os.getpid()}-{secrets.token_hex(4)}"


def parse(line: str) -> Step:
    """`step key=value ...` as cgmem prints it; numbers as ints."""
    step, *pairs = line.split()
    fields: dict[str, int | str] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        fields[key] = int(value) if value.lstrip("-").isdigit() else value
    return step, fields


class Program:
    """cgmem running `steps`, placed in `cgroup` before it starts (else where the test is), under `prefix` (another
    user, a user namespace); it stops at each `wait` step until go()."""

    def __init__(self, gpu: FakeGpu | Path, *steps: object, cgroup: Path | None = None, prefix: list[str] | None = None) -> None:
        folder = gpu.folder if isinstance(gpu, FakeGpu) else gpu
        placed = ["sh", "-c", PLACE, str(cgroup)] if cgroup is not None else []
        self.process = subprocess.Popen([*placed, *(prefix or []), str(CGMEM), *map(str, steps)],
                                        env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(folder)},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def said(self) -> list[Step]:
        """What it printed up to its next `wait` (or its end)."""
        assert self.process.stdout is not None
        steps: list[Step] = []
        for line in self.process.stdout:
            if line.strip() == "waiting":
                return steps
            steps.append(parse(line))
        return steps

    def go(self) -> list[Step]:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return self.said()

    def finish(self) -> list[Step]:
        """The rest of its steps; it must exit by itself, and cleanly (the driver kills nothing)."""
        assert self.process.stdin is not None and self.process.stderr is not None
        self.process.stdin.close()
        rest = self.said()
        assert self.process.wait(30) == 0, self.process.stderr.read()
        return rest

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def run(gpu: FakeGpu | Path, *steps: object, cgroup: Path | None = None, prefix: list[str] | None = None) -> list[Step]:
    """cgmem from start to end: every step it printed."""
    program = Program(gpu, *steps, cgroup=cgroup, prefix=prefix)
    try:
        return program.finish()
    finally:
        program.stop()


def one(steps: list[Step], name: str) -> dict[str, int | str]:
    """The fields of the one step called `name`."""
    [fields] = [fields for step, fields in steps if step == name]
    return fields


def rcs(steps: list[Step], name: str) -> list[int | str]:
    """The return codes of every step called `name`, in order."""
    return [fields["rc"] for step, fields in steps if step == name]


class Programs:
    """Every program a test starts, stopped at its end (before its cgroups are removed)."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.running: list[Program] = []

    def start(self, *steps: object, cgroup: Path | None = None, prefix: list[str] | None = None) -> Program:
        program = Program(self.gpu, *steps, cgroup=cgroup, prefix=prefix)
        self.running.append(program)
        return program

    def stop(self) -> None:
        for program in self.running:
            program.stop()


def programs_on(gpu: FakeGpu) -> Iterator[Programs]:
    """A fixture's body: the programs of one test on `gpu`."""
    started = Programs(gpu)
    try:
        yield started
    finally:
        started.stop()
