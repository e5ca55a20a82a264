"""The fake GPU's node-side ledger: the process that owns what every process holds on the fake devices, as a
real GPU's kernel driver does, so that no tenant can change the ground truth the security tests judge by.

hami-core's fake libcuda.so.1 and libnvidia-ml.so.1 reach it through `fake-gpu.sock` in their own directory
(found from the library's own path, never from the environment), over the protocol of
hami-core/fake/fake_ledger.h. Every charge belongs to the connection it came on, and to the process the kernel
says opened that connection (SO_PEERCRED; each message's SCM_CREDENTIALS must name the same process, so a
descriptor passed to or inherited by another process is refused). A connection's charges go when it closes (as
the real driver's do when its device files close: exit, exec, close) or when its process dies (its pidfd).
Besides the cuMemAlloc family it models what a real driver spends outside it: a fixed overhead per context,
cuCtxSetLimit's heap, stack and printf FIFO, module globals, and imports (IPC and shareable handles), all
charged to the process in NVML's process list.

The driver's kind is the node's, chosen when the ledger starts (`--driver-branch`), never by anything a tenant
sets: 580 (the default) has no per-cgroup memory limits; 615 has NVML 13.4's (nvmlDeviceSetMemoryLimits_v1 /
GetMemoryLimits_v1), which the ledger enforces as the R615 driver does: it charges each allocation to the cgroup
v2 the allocating process is in at that moment (read from the kernel, /proc/<pid>/cgroup), refuses one that would
take a limited cgroup past its hard limit (CUDA_ERROR_OUT_OF_MEMORY, nothing killed), and shows the device to a
process in that cgroup capped to the limit (cuMemGetInfo, nvmlDeviceGetMemoryInfo_v2). A limit applies to the
processes of exactly the cgroup it is set on (the container's leaf; NVIDIA measured a parent's limit not to show).
A DEV AND TEST FIXTURE beside the other stand-ins (services/devcluster/), which only the dev stack and the tests import:
`python -m kai_isolator.services.devcluster.fake_gpu_ledger`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import resource
import secrets
import select
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SOCKET_NAME = "fake-gpu.sock"
LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")
DEFAULT_BUILD = Path(__file__).resolve().parents[2] / "hami-core" / "build" / "fake"
MIB = 1 << 20
SLOTS = 17  # 16 devices, then host VMM memory (cuMemCreate on a host location)
HOST_SLOT = 16

FAKE_CONTEXT_OVERHEAD_BYTES = 4 * MIB
"""Device memory the fake driver charges for each context (primary or created) on top of what the context
allocates: small on purpose, so tests read figures easily, yet never zero, so that the enforcer is tested
against a driver that charges contexts as a real one does (about 300 MiB on a Hopper card, see
services/nodeagent/enforce.py). It covers the context's state and its limits at their defaults."""
RESIDENT_THREADS = 40 * 1024
"""Threads resident at once on the fake card (40 SMs x 1024, its device attributes): the driver reserves
CU_LIMIT_STACK_SIZE bytes of local memory for each."""
LIMIT_STACK, LIMIT_PRINTF_FIFO, LIMIT_MALLOC_HEAP = 0, 1, 2
LIMIT_DEFAULTS = {LIMIT_STACK: 1024, LIMIT_PRINTF_FIFO: 1 * MIB, LIMIT_MALLOC_HEAP: 8 * MIB}

REQUEST = struct.Struct("<Iiqq")  # fake_ledger_request: op, dev, a, b (a and b read as unsigned below)
REPLY = struct.Struct("<iI5Q")  # fake_ledger_reply: status, count, v[5]
PROCESS = struct.Struct("<IIQ")  # fake_ledger_process: pid, pad, bytes
MAX_PROCESSES = 4096
UCRED = struct.Struct("<iII")  # struct ucred: pid, uid, gid
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5; os.pidfd_open where the kernel lacks it

CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY = 0, 1, 2
CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_NOT_PERMITTED = 101, 400, 800
# nvml.h's codes, the status of the two limit operations.
NVML_SUCCESS, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION = 0, 2, 3, 4
NVML_ERROR_NOT_FOUND, NVML_ERROR_OPERATING_SYSTEM = 6, 17
MEMORY_LIMIT_MAX = 2**64 - 1  # NVML_DEVICE_MEMORY_LIMIT_MAX: no hard limit

OP_HELLO, OP_ALLOC, OP_FREE, OP_STATS, OP_PROCESSES, OP_CONTEXT, OP_LIMIT, OP_MODULE = range(1, 9)
OP_EXPORT, OP_IMPORT_TOKEN, OP_IMPORT_FD = 9, 10, 11
OP_MEMINFO, OP_SET_LIMITS, OP_GET_LIMITS = 12, 13, 14
ALLOC_MANAGED = 1  # FAKE_ALLOC_MANAGED: cuMemAllocManaged, which no cgroup's limit caps on the device


@dataclass(frozen=True, slots=True)
class DriverBranch:
    """A kind of real driver the fake can be: its version, the CUDA version it supports, and whether it has NVML
    13.4's per-cgroup memory limits."""

    version: tuple[int, int, int]
    cuda: int
    memory_limits: bool


BRANCHES = {580: DriverBranch((580, 65, 6), 13000, False), 615: DriverBranch((615, 71, 9), 13040, True)}
DEFAULT_BRANCH = 580  # what every node was before R615: nothing that predates the option changes

MEMORY, RESERVED, IMPORTED = "memory", "reserved", "imported"
"""Kinds of charge: the cuMemAlloc family (a device's `used`), what the driver spends outside it (its
`reserved`: contexts, limits, modules), and memory another process exported (charged to the importer in its
process record, not again to the device, whose bytes the exporter's allocation already are)."""


@contextlib.contextmanager
def _through_folder(path: Path) -> Iterator[str]:
    """`path` as /proc/self/fd/N/<name> through its folder's descriptor: a socket path is limited to 108 bytes,
    and a node's work dir (a test's tmp_path, say) is often longer than that."""
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)

class FakeGpuError(RuntimeError):
    """The ledger did not start, or answered a query with an error."""


CgroupId = tuple[int, int]
"""A cgroup v2 directory's (st_dev, st_ino): the kernel's name for it, which a cgroup made again at the same path
does not share (its inode is the cgroup's 64-bit id, never reused), so a removed cgroup's limit dies with it."""


def _unescape(field: str) -> str:
    """A path as /proc/self/mountinfo writes it, with spaces and the like as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


class Cgroups:
    """The node's cgroup v2 hierarchy as the kernel shows it to the ledger: where it is mounted (the ledger's
    mountinfo; /sys/fs/cgroup on a v2 host, /sys/fs/cgroup/unified beside v1), which cgroup a process is in now
    (the `0::` line of /proc/<pid>/cgroup) and the identity of a directory a caller opened."""

    def __init__(self) -> None:
        self.mounts: list[tuple[str, str]] = []  # (root inside the hierarchy, mount point)
        self.devices: set[int] = set()
        self.refresh()

    def refresh(self) -> None:
        mounts, devices = [], set()
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/mountinfo").read_text().splitlines():
                fields = line.split()
                tail = fields.index("-")
                if fields[tail + 1] == "cgroup2":
                    major, minor = fields[2].split(":")
                    devices.add(os.makedev(int(major), int(minor)))
                    mounts.append((_unescape(fields[3]), _unescape(fields[4])))
        self.mounts, self.devices = mounts, devices

    def named_by(self, fd: int) -> tuple[str, CgroupId] | None:
        """The cgroup v2 directory an open descriptor names, and its path; None for anything else (a v1
        hierarchy's directory, a file, a directory elsewhere)."""
        st = os.fstat(fd)
        if st.st_dev not in self.devices:
            self.refresh()  # mounted since the ledger looked
        if not stat.S_ISDIR(st.st_mode) or st.st_dev not in self.devices:
            return None
        return os.readlink(f"/proc/self/fd/{fd}"), (st.st_dev, st.st_ino)

    def of_process(self, pid: int) -> CgroupId | None:
        """The cgroup v2 `pid` is in now, as the kernel says; None when it cannot say (the process is gone, or no
        v2 hierarchy is mounted where the ledger can see it)."""
        try:  # at every charge: os.read is a third of what Path.read_text costs
            fd = os.open(f"/proc/{pid}/cgroup", os.O_RDONLY | os.O_CLOEXEC)
            try:
                text = os.read(fd, 1 << 16).decode(errors="surrogateescape")
            finally:
                os.close(fd)
        except OSError:
            return None
        inside = next((line[3:] for line in text.splitlines() if line.startswith("0::")), None)
        if inside is None:
            return None
        for root, point in self.mounts:
            if root == "/" or inside == root or inside.startswith(root + "/"):
                try:
                    st = os.stat(point + inside[len(root.rstrip("/")):])
                except OSError:
                    continue
                if st.st_dev in self.devices:
                    return st.st_dev, st.st_ino
        return None

    @staticmethod
    def alive(path: str, cgroup: CgroupId) -> bool:
        """Whether the cgroup still exists: its path still names the same directory."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == cgroup


@dataclass(slots=True)
class MemoryLimit:
    """A cgroup's limits on one device, as nvmlDeviceSetMemoryLimits_v1 set them."""

    path: str  # the cgroup's directory as the ledger found it, to see when it is removed
    soft: int
    hard: int


@dataclass(slots=True)
class Charge:
    dev: int
    bytes: int
    kind: str
    cgroup: CgroupId | None = None  # the cgroup it counts against (R615), the one its process was in when charged


@dataclass(slots=True)
class Connection:
    """One process's link to the ledger and everything charged through it."""

    sock: socket.socket
    pid: int
    pidfd: int
    uid: int  # effective uid when it connected, in the ledger's user namespace (a container's root is not 0)
    charges: dict[int, Charge] = field(default_factory=dict)
    limits: dict[tuple[int, int], int] = field(default_factory=dict)  # (dev, CUlimit) -> handle


@dataclass(slots=True)
class Device:
    used: int = 0
    reserved: int = 0
    peak: int = 0
    allocs: int = 0
    frees: int = 0


def limit_footprint(limit: int, value: int) -> int:
    """Device bytes the driver reserves for a limit at `value` beyond what it reserves at the default (inside
    FAKE_CONTEXT_OVERHEAD_BYTES): the stack size for every resident thread, the heap and FIFO as they are."""
    scale = RESIDENT_THREADS if limit == LIMIT_STACK else 1
    return max(0, (value - LIMIT_DEFAULTS[limit]) * scale)


class Ledger:
    """The books and the socket that keeps them; one thread, one request at a time (run() until stop())."""

    def __init__(self, path: Path, devices: int, total_bytes: int, branch: int = DEFAULT_BRANCH) -> None:
        if not 1 <= devices <= 16 or total_bytes <= 0:
            raise FakeGpuError(f"a fake GPU needs 1..16 devices and a positive size, not {devices} x {total_bytes}")
        if branch not in BRANCHES:
            raise FakeGpuError(f"the fake driver is branch {' or '.join(map(str, BRANCHES))}, not {branch}")
        self.path = path
        self.count = devices
        self.total = total_bytes
        self.branch = BRANCHES[branch]
        self.cgroups = Cgroups() if self.branch.memory_limits else None
        self.limits: dict[tuple[int, CgroupId], MemoryLimit] = {}  # (device, cgroup) -> its limits
        self.cgroup_used: dict[tuple[int, CgroupId], int] = {}  # (device, cgroup) -> bytes charged against it
        self.devices = [Device() for _ in range(SLOTS)]
        self.connections: dict[int, Connection] = {}  # by socket fd
        self.exports: dict[bytes, tuple[Connection, int]] = {}  # token -> (owner, handle)
        self.export_files: dict[int, bytes] = {}  # memfd inode -> token
        self.export_fds: dict[bytes, int] = {}
        self.next_handle = 1
        self.selector = selectors.DefaultSelector()
        self.stopped = False
        path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        # Set on the listener so every accepted socket has it before its first message can arrive.
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        with _through_folder(path) as short:
            self.listener.bind(short)
        os.chmod(path, 0o666)  # every container's processes, whatever their uid, reach the GPU
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")

    # --- connections -------------------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        except OSError as error:  # out of descriptors: the caller's connect waits in the backlog, then times out
            print(f"fake_gpu: cannot accept a process: {error}", file=sys.stderr, flush=True)
            time.sleep(0.05)
            return
        pid, uid, _ = UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))
        try:
            pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError:
            try:
                pidfd = os.pidfd_open(pid)  # a small window for pid reuse, closed where SO_PEERPIDFD exists
            except OSError:
                sock.close()
                return
        os.set_inheritable(pidfd, False)
        sock.setblocking(False)
        conn = Connection(sock, pid, pidfd, uid)
        self.connections[sock.fileno()] = conn
        self.selector.register(sock, selectors.EVENT_READ, conn)
        self.selector.register(pidfd, selectors.EVENT_READ, ("died", conn))

    def _drop(self, conn: Connection) -> None:
        """The connection's process closed it or died: everything charged through it is released."""
        if self.connections.pop(conn.sock.fileno(), None) is None:
            return
        for handle in list(conn.charges):
            self._release(conn, handle)
        for token in [t for t, (owner, _) in self.exports.items() if owner is conn]:
            self._unexport(token)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.pidfd)
        conn.sock.close()
        os.close(conn.pidfd)

    def _sweep(self) -> None:
        """Drop every connection already closed or whose process is gone, before a device-wide answer: what a
        process held before its exit or exec must not show after it (the real driver tears it down first)."""
        poller = select.poll()
        watched: dict[int, Connection] = {}
        for conn in self.connections.values():
            poller.register(conn.pidfd, select.POLLIN)
            poller.register(conn.sock.fileno(), select.POLLIN | select.POLLHUP)
            watched[conn.pidfd] = watched[conn.sock.fileno()] = conn
        for fd, events in poller.poll(0):
            conn = watched[fd]
            if fd == conn.pidfd or events & (select.POLLHUP | select.POLLERR):
                self._drop(conn)

    # --- charges ------------------------------------------------------------------------------------

    def _fits(self, dev: int, nbytes: int, cgroup: CgroupId | None) -> bool:
        """Room on the device, and within the hard limit of the cgroup the bytes would count against."""
        device = self.devices[dev]
        if nbytes > self.total - device.used - device.reserved:
            return False
        limit = self.limits.get((dev, cgroup)) if cgroup is not None else None
        return limit is None or nbytes <= limit.hard - self.cgroup_used.get((dev, cgroup), 0)  # type: ignore[arg-type]

    def _cgroup_of(self, conn: Connection, dev: int) -> CgroupId | None:
        """The cgroup whose account device memory on `dev` goes to: the process's now (R615; None before)."""
        return self.cgroups.of_process(conn.pid) if self.cgroups is not None and dev != HOST_SLOT else None

    def _charge(self, conn: Connection, dev: int, nbytes: int, kind: str, managed: bool = False) -> int | None:
        device = self.devices[dev]
        cgroup = None
        if kind != IMPORTED:  # an import takes no new device memory: the exporter's cgroup holds it
            cgroup = None if managed else self._cgroup_of(conn, dev)
            if not self._fits(dev, nbytes, cgroup):
                # Memory of a process that died may still be on the books, its pidfd not yet read: the real driver
                # tears it down before it answers, so look again without it before refusing.
                self._sweep()
                if self.connections.get(conn.sock.fileno()) is not conn or not self._fits(dev, nbytes, cgroup):
                    return None
            if cgroup is not None:
                self.cgroup_used[(dev, cgroup)] = self.cgroup_used.get((dev, cgroup), 0) + nbytes
            if kind == MEMORY:
                device.used += nbytes
                device.allocs += 1
                device.peak = max(device.peak, device.used)
            else:
                device.reserved += nbytes
        handle = self.next_handle
        self.next_handle += 1
        conn.charges[handle] = Charge(dev, nbytes, kind, cgroup)
        return handle

    def _release(self, conn: Connection, handle: int) -> bool:
        charge = conn.charges.pop(handle, None)
        if charge is None:
            return False
        device = self.devices[charge.dev]
        if charge.cgroup is not None:
            key = (charge.dev, charge.cgroup)
            self.cgroup_used[key] -= charge.bytes
            if not self.cgroup_used[key]:
                del self.cgroup_used[key]
        if charge.kind == MEMORY:
            device.used -= charge.bytes
            device.frees += 1
        elif charge.kind == RESERVED:
            device.reserved -= charge.bytes
        for token in [t for t, (owner, h) in self.exports.items() if owner is conn and h == handle]:
            self._unexport(token)
        return True

    def _unexport(self, token: bytes) -> None:
        self.exports.pop(token, None)
        fd = self.export_fds.pop(token, None)
        if fd is not None:
            self.export_files = {ino: t for ino, t in self.export_files.items() if t != token}
            os.close(fd)

    def _device(self, dev: int, host_ok: bool = False) -> bool:
        return 0 <= dev < self.count or (host_ok and dev == HOST_SLOT)

    def processes(self, dev: int) -> list[tuple[int, int]]:
        """(host PID, bytes charged on `dev`) of every process holding anything there, by PID."""
        held: dict[int, int] = {}
        for conn in self.connections.values():
            total = sum(c.bytes for c in conn.charges.values() if c.dev == dev)
            if total:
                held[conn.pid] = held.get(conn.pid, 0) + total
        return sorted(held.items())[:MAX_PROCESSES]

    # --- requests -----------------------------------------------------------------------------------

    def _handle(self, conn: Connection, op: int, dev: int, a: int, b: int, fds: list[int]) -> tuple[bytes, list[int]]:
        def reply(status: int = CUDA_SUCCESS, *values: int, count: int = 0) -> bytes:
            return REPLY.pack(status, count, *(list(values) + [0] * 5)[:5])

        if op == OP_HELLO:
            major, minor, patch = self.branch.version
            return reply(CUDA_SUCCESS, self.count, self.total, major, minor << 16 | patch, self.branch.cuda), []
        if op in (OP_ALLOC, OP_CONTEXT, OP_MODULE):
            if not self._device(dev, host_ok=op == OP_ALLOC):
                return reply(CUDA_ERROR_INVALID_DEVICE), []
            nbytes = {OP_ALLOC: a, OP_CONTEXT: FAKE_CONTEXT_OVERHEAD_BYTES, OP_MODULE: a}[op]
            if op == OP_ALLOC and (nbytes == 0 or b & ~ALLOC_MANAGED):
                return reply(CUDA_ERROR_INVALID_VALUE), []
            managed = op == OP_ALLOC and b & ALLOC_MANAGED != 0
            handle = self._charge(conn, dev, nbytes, MEMORY if op == OP_ALLOC else RESERVED, managed)
            return (reply(CUDA_ERROR_OUT_OF_MEMORY) if handle is None else reply(CUDA_SUCCESS, handle)), []
        if op == OP_FREE:
            return reply(CUDA_SUCCESS if self._release(conn, a) else CUDA_ERROR_INVALID_HANDLE), []
        if op == OP_LIMIT:
            if not self._device(dev) or a not in LIMIT_DEFAULTS:
                return reply(CUDA_ERROR_INVALID_VALUE), []
            old = conn.limits.pop((dev, a), None)
            previous = conn.charges.get(old) if old is not None else None
            if previous is not None:
                self._release(conn, old)  # type: ignore[arg-type]
            nbytes = limit_footprint(a, b)
            handle = self._charge(conn, dev, nbytes, RESERVED)
            if handle is None:  # the driver keeps the old limit when the new one does not fit
                if previous is not None:
                    kept = self._charge(conn, dev, previous.bytes, RESERVED)
                    if kept is not None:
                        conn.limits[(dev, a)] = kept
                return reply(CUDA_ERROR_OUT_OF_MEMORY), []
            conn.limits[(dev, a)] = handle
            return reply(CUDA_SUCCESS, nbytes), []
        if op == OP_STATS:
            if not self._device(dev, host_ok=True):
                return reply(CUDA_ERROR_INVALID_DEVICE), []
            self._sweep()
            d = self.devices[dev]
            return reply(CUDA_SUCCESS, d.used, d.peak, d.allocs, d.frees, d.reserved), []
        if op == OP_MEMINFO:
            if not self._device(dev):
                return reply(CUDA_ERROR_INVALID_DEVICE), []
            self._sweep()
            return reply(CUDA_SUCCESS, *self.memory_view(conn, dev)), []
        if op == OP_SET_LIMITS:
            return reply(self._set_limits(conn, dev, a, b, fds[0] if fds else None)), []
        if op == OP_GET_LIMITS:
            status, values = self._get_limits(dev, fds[0] if fds else None)
            return reply(status, *values), []
        if op == OP_PROCESSES:
            if not self._device(dev):
                return reply(CUDA_ERROR_INVALID_DEVICE), []
            self._sweep()
            procs = self.processes(dev)
            return reply(CUDA_SUCCESS, count=len(procs)) + b"".join(PROCESS.pack(p, 0, n) for p, n in procs), []
        if op == OP_EXPORT:
            charge = conn.charges.get(a)
            if charge is None or charge.kind != MEMORY:
                return reply(CUDA_ERROR_INVALID_HANDLE), []
            token = secrets.token_bytes(16)
            memfd = os.memfd_create("fake-gpu-export", os.MFD_CLOEXEC)
            self.exports[token] = (conn, a)
            self.export_fds[token] = memfd
            self.export_files[os.fstat(memfd).st_ino] = token
            first, second = struct.unpack("<QQ", token)
            return reply(CUDA_SUCCESS, first, second), [memfd]
        if op in (OP_IMPORT_TOKEN, OP_IMPORT_FD):
            if op == OP_IMPORT_TOKEN:
                token: bytes | None = struct.pack("<QQ", a, b)
            else:
                token = self._token_of(fds[0]) if fds else None
            found = self.exports.get(token) if token is not None else None
            exported = found[0].charges.get(found[1]) if found else None
            if found is None or exported is None:
                return reply(CUDA_ERROR_INVALID_HANDLE), []
            handle = self._charge(conn, exported.dev, exported.bytes, IMPORTED)
            assert handle is not None  # an import takes no new device memory
            return reply(CUDA_SUCCESS, handle, exported.bytes, exported.dev), []
        return reply(CUDA_ERROR_INVALID_VALUE), []

    # --- per-cgroup limits (R615) ------------------------------------------------------------------

    def memory_view(self, conn: Connection, dev: int) -> tuple[int, int, int]:
        """(total, free, used) of `dev` as the caller sees it: inside a cgroup with a hard limit there, capped to
        the limit (free never above what the device really has free, never below 0); elsewhere, the device."""
        device = self.devices[dev]
        free = self.total - device.used - device.reserved
        cgroup = self._cgroup_of(conn, dev)
        limit = self.limits.get((dev, cgroup)) if cgroup is not None else None
        if limit is None or limit.hard == MEMORY_LIMIT_MAX:
            return self.total, free, device.used + device.reserved
        held = self.cgroup_used.get((dev, cgroup), 0)  # type: ignore[arg-type]
        return limit.hard, max(0, min(limit.hard - held, free)), held

    def _named_cgroup(self, fd: int | None) -> tuple[str, CgroupId] | None:
        """The cgroup a limit request names by its open directory, having first forgotten the limits of every
        cgroup removed since (removing a cgroup clears its limits)."""
        assert self.cgroups is not None
        self.limits = {key: limit for key, limit in self.limits.items() if self.cgroups.alive(limit.path, key[1])}
        return self.cgroups.named_by(fd) if fd is not None else None

    def _set_limits(self, conn: Connection, dev: int, soft: int, hard: int, fd: int | None) -> int:
        """nvmlDeviceSetMemoryLimits_v1 as the driver checks it, in this order: a driver that has it, a device,
        root, a cgroup v2 directory, then the values (soft <= hard, neither past the device unless hard is MAX).
        Soft 0 with hard MAX clears the cgroup's limits."""
        if self.cgroups is None:
            return NVML_ERROR_NOT_SUPPORTED
        if not self._device(dev):
            return NVML_ERROR_INVALID_ARGUMENT
        if conn.uid != 0:
            return NVML_ERROR_NO_PERMISSION
        named = self._named_cgroup(fd)
        if named is None:
            return NVML_ERROR_OPERATING_SYSTEM
        if soft > hard or soft > self.total or (hard != MEMORY_LIMIT_MAX and hard > self.total):
            return NVML_ERROR_INVALID_ARGUMENT
        path, cgroup = named
        if soft == 0 and hard == MEMORY_LIMIT_MAX:
            self.limits.pop((dev, cgroup), None)
        else:
            self.limits[(dev, cgroup)] = MemoryLimit(path, soft, hard)
        return NVML_SUCCESS

    def _get_limits(self, dev: int, fd: int | None) -> tuple[int, tuple[int, ...]]:
        """nvmlDeviceGetMemoryLimits_v1: (status, (soft, hard, current use)); any uid may ask."""
        if self.cgroups is None:
            return NVML_ERROR_NOT_SUPPORTED, ()
        if not self._device(dev):
            return NVML_ERROR_INVALID_ARGUMENT, ()
        named = self._named_cgroup(fd)
        if named is None:
            return NVML_ERROR_OPERATING_SYSTEM, ()
        limit = self.limits.get((dev, named[1]))
        if limit is None:
            return NVML_ERROR_NOT_FOUND, ()
        self._sweep()  # what the dead held is not in use
        return NVML_SUCCESS, (limit.soft, limit.hard, self.cgroup_used.get((dev, named[1]), 0))

    def _token_of(self, fd: int) -> bytes | None:
        """The export an fd names: by the identity of the file the ledger made, which no process can forge."""
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        token = self.export_files.get(st.st_ino)
        if token is None or os.fstat(self.export_fds[token]).st_dev != st.st_dev:
            return None
        return token

    def _serve(self, conn: Connection) -> None:
        try:
            data, ancdata, _, _ = conn.sock.recvmsg(REQUEST.size + 1, socket.CMSG_SPACE(UCRED.size) + socket.CMSG_SPACE(4 * 4))
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        sender, fds = None, []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= UCRED.size:
                sender = UCRED.unpack_from(payload)[0]
            elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(struct.unpack(f"<{len(payload) // 4}i", payload[: len(payload) // 4 * 4]))
        try:
            if len(data) != REQUEST.size:
                answer, out = REPLY.pack(CUDA_ERROR_INVALID_VALUE, 0, 0, 0, 0, 0, 0), []
            elif sender != conn.pid:
                # Another process on this connection (inherited across fork, or passed to it), or a message
                # that claims someone else: charged to nobody, and told so.
                answer, out = REPLY.pack(CUDA_ERROR_NOT_PERMITTED, 0, 0, 0, 0, 0, 0), []
            else:
                op, dev, a, b = REQUEST.unpack(data)
                answer, out = self._handle(conn, op, dev, a & (2**64 - 1), b & (2**64 - 1), fds)
        finally:
            for fd in fds:
                os.close(fd)
        if self.connections.get(conn.sock.fileno()) is not conn:
            return  # its process died while the ledger answered (a sweep dropped it): nobody to tell
        try:
            conn.sock.sendmsg([answer], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"<{len(out)}i", *out))] if out else [])
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EPIPE, errno.ECONNRESET):
                raise
            self._drop(conn)

    def run(self) -> None:
        while not self.stopped:
            for key, _ in self.selector.select(timeout=0.5):
                if key.data == "accept":
                    self._accept()
                elif isinstance(key.data, tuple):
                    self._drop(key.data[1])
                elif key.data.sock.fileno() in self.connections:
                    self._serve(key.data)

    def stop(self) -> None:
        self.stopped = True

    def close(self) -> None:
        for conn in list(self.connections.values()):
            self._drop(conn)
        self.selector.close()
        self.listener.close()
        for fd in self.export_fds.values():
            os.close(fd)
        self.path.unlink(missing_ok=True)


# --- the node's side: a folder with the fake driver and its ledger -------------------------------------

class FakeGpu:
    """A fake GPU for one node: a driver folder with copies of the fake libraries and the ledger process
    serving `fake-gpu.sock` beside them. Point LD_LIBRARY_PATH (or the NVML path) at `folder`."""

    def __init__(self, folder: Path, devices: int = 1, total_mib: int = 15360, build: Path = DEFAULT_BUILD,
                 driver_branch: int = DEFAULT_BRANCH) -> None:
        self.folder = folder
        self.devices = devices
        self.total_mib = total_mib
        self.build = build
        self.driver_branch = driver_branch
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.folder / SOCKET_NAME

    @property
    def nvml(self) -> Path:
        return self.folder / "libnvidia-ml.so.1"

    def install(self) -> None:
        """Copy the fake libraries in (a copy: rebuilding hami-core does not change a running node)."""
        missing = [name for name in LIBRARIES if not (self.build / name).is_file()]
        if missing:
            raise FakeGpuError(f"the fake driver is not built ({', '.join(missing)} in {self.build}): run `make -C hami-core`")
        self.folder.mkdir(parents=True, exist_ok=True)
        for name in LIBRARIES:
            shutil.copy2(self.build / name, self.folder / name)
            link = self.folder / name.removesuffix(".1")  # the development names a driver install has too
            link.unlink(missing_ok=True)
            link.symlink_to(name)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kai_isolator.services.devcluster.fake_gpu_ledger", f"--socket={self.socket}",
                f"--devices={self.devices}", f"--total-mib={self.total_mib}", f"--driver-branch={self.driver_branch}"]

    def start(self, timeout_s: float = 15.0) -> FakeGpu:
        self.install()
        log = self.folder / "fake-gpu.log"
        with log.open("ab") as errors:
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors,
                                            start_new_session=True)
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else b""
        if not line.startswith(b"ready"):
            self.stop()
            said = " | ".join(log.read_text(errors="replace").splitlines()[-3:]) or repr(line)
            raise FakeGpuError(f"the fake GPU's ledger did not start within {timeout_s}s: {said}")
        return self

    def stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(10)
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process = None

    def __enter__(self) -> FakeGpu:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what the ledger says (the ground truth of the tests) ---

    def _call(self, op: int, dev: int = 0) -> tuple[tuple[int, ...], bytes]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(10)
            with _through_folder(self.socket) as short:
                sock.connect(short)
            sock.send(REQUEST.pack(op, dev, 0, 0))
            data = sock.recv(REPLY.size + MAX_PROCESSES * PROCESS.size)
        head = REPLY.unpack_from(data)
        if head[0] != CUDA_SUCCESS:
            raise FakeGpuError(f"the ledger answered {head[0]} to op {op} on device {dev}")
        return head, data[REPLY.size:]

    def stats(self, dev: int = 0) -> dict[str, int]:
        """The device's counters: `used` by the cuMemAlloc family, `reserved` outside it, and `total`."""
        head, _ = self._call(OP_STATS, dev)
        used, peak, allocs, frees, reserved = head[2:]
        return {"used": used, "peak": peak, "allocs": allocs, "frees": frees, "reserved": reserved,
                "total": self.total_mib * MIB}

    def processes(self, dev: int = 0) -> dict[int, int]:
        """Host PID -> bytes charged on `dev`, as NVML's process list shows them."""
        head, rest = self._call(OP_PROCESSES, dev)
        return {pid: nbytes for pid, _, nbytes in PROCESS.iter_unpack(rest[: head[1] * PROCESS.size])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake_gpu", description="the fake GPU's node-side ledger (dev/test fixture)")
    parser.add_argument("--socket", type=Path, required=True, help=f"where to listen: {SOCKET_NAME} next to the fake libraries")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--total-mib", type=int, default=15360)
    parser.add_argument("--driver-branch", type=int, default=DEFAULT_BRANCH,
                        help="the real driver the fake is: 580 (no per-cgroup memory limits) or 615 (NVML 13.4's)")
    args = parser.parse_args(argv)
    # Two descriptors per process (its link and its pidfd): a node of a thousand GPU processes needs more than 1024.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        ledger = Ledger(args.socket, args.devices, args.total_mib * MIB, args.driver_branch)
    except (FakeGpuError, OSError) as error:
        print(f"fake_gpu: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signo, frame: ledger.stop())
    signal.signal(signal.SIGINT, lambda signo, frame: ledger.stop())
    print(f"ready {args.socket}", flush=True)
    started = time.monotonic()
    try:
        ledger.run()
    finally:
        ledger.close()
    print(f"fake_gpu: stopped after {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
