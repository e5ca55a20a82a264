"""The fake driver is the judge of every security test, so it must be no weaker than a real one (issue 26): its
ledger and NVML's process list depend on nothing the tenant controls (its environment, its descriptors, files it
can write, pids it can name), and it charges what a real driver spends outside cuMemAlloc (contexts, limits,
modules, imports) to the process, as a real NVML does. Each attack runs for real against the node-side ledger.
On an R615 node the driver's per-cgroup limit is set by root only: a tenant can lift it neither through NVML nor
by talking to the ledger itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_isolator.services.devcluster import fake_gpu_ledger as fake_gpu
from kai_isolator.services.devcluster.fake_gpu_ledger import FAKE_CONTEXT_OVERHEAD_BYTES as CONTEXT
from kai_isolator.services.devcluster.fake_gpu_ledger import FakeGpu
from kai_isolator.services.nodeagent.nvml import Nvml
from security.container import CUPROBE, GIB, MIB
from support.cgroups import OWN_USER_NAMESPACE, PLACE, make_tree, one, readable_gpu, remove_tree, run, unique_top, v2_mount

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenants run as another user and in their own namespaces (root)")

SYSTEM_PYTHON = "/usr/bin/python3"  # a tenant's interpreter: standard library only, readable by any uid
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
CARD = 15360 * MIB

# What a tenant's program starts with: the driver API through ctypes, as any CUDA program reaches it.
PRELUDE = r'''
import ctypes, json, os, socket, struct, sys
cu = ctypes.CDLL("libcuda.so.1")
cu.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
def say(**fields):
    print(json.dumps(fields), flush=True)
def wait():
    return sys.stdin.readline().strip()
def context():
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int()
    assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    return dev
def alloc(n):
    p = ctypes.c_uint64()
    return cu.cuMemAlloc_v2(ctypes.byref(p), n), p.value
def ledger_fds():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                found.append(int(fd))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return found
'''


class Tenant:
    """A program of the tenant's, talking JSON lines; it waits on stdin wherever its script calls wait()."""

    def __init__(self, script: str, env: dict[str, str], prefix: list[str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.process = subprocess.Popen([*(prefix or []), SYSTEM_PYTHON, "-c", PRELUDE + script], env=env, pass_fds=pass_fds,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def said(self) -> dict[str, object]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            assert self.process.stderr is not None
            raise AssertionError(f"the tenant exited ({self.process.wait()}): {self.process.stderr.read()}")
        return json.loads(line)

    def go(self) -> dict[str, object]:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return self.said()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def gpu() -> Iterator[FakeGpu]:
    """A node's fake GPU in a folder every uid can read (as a node's driver folder is), owned by root."""
    with readable_gpu() as started:
        yield started


@pytest.fixture
def tenants() -> Iterator[list[Tenant]]:
    running: list[Tenant] = []
    yield running
    for tenant in running:
        tenant.stop()


def env_of(gpu: FakeGpu, **extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(gpu.folder), **extra}


def nvml_view(gpu: FakeGpu) -> dict[int, int | None]:
    """Host PID -> bytes on device 0, read as the node agent's enforcer reads them."""
    return {p.pid: p.used_bytes for p in Nvml(str(gpu.nvml)).snapshot().processes if p.device_index == 0}


def exited(pid: int, timeout_s: float = 10) -> bool:
    """Until `pid` has exited (gone, or a zombie: its descriptors are closed by then), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def holder(gpu: FakeGpu, tenants: list[Tenant], nbytes: int, **extra: str) -> Tenant:
    started = Tenant(f"context(); rc, _ = alloc({nbytes}); say(rc=rc); wait()", env_of(gpu, **extra))
    tenants.append(started)
    assert started.said() == {"rc": 0}
    return started


# --- the ledger depends on nothing the tenant controls -----------------------------------------------


def test_the_environment_neither_enlarges_the_card_nor_redirects_the_books(gpu: FakeGpu, tenants: list[Tenant]) -> None:
    victim = holder(gpu, tenants, GIB)
    forged = Path(tempfile.mkdtemp(prefix="tenant-", dir="/tmp")) / "ledger"
    forged.parent.chmod(0o777)
    forged.write_bytes(bytes(4096))  # a books file of the tenant's own, the way the old fake driver was told where to keep them
    forged.chmod(0o666)
    script = """
        context()
        count, total = ctypes.c_int(), ctypes.c_size_t()
        cu.cuDeviceGetCount(ctypes.byref(count)); cu.cuDeviceTotalMem_v2(ctypes.byref(total), 0)
        big, _ = alloc(16 * (1 << 30))
        small, _ = alloc(1 << 30)
        say(count=count.value, total=total.value, big=big, small=small)
        wait()
    """
    attacker = Tenant("\n".join(line[8:] for line in script.splitlines()),
                      env_of(gpu, FAKE_CUDA_STATE=str(forged), FAKE_CUDA_TOTAL_MIB=str(1 << 20), FAKE_CUDA_DEVICES="16"), NOBODY)
    tenants.append(attacker)
    # The card is the ledger's: one 15 GiB device, and 16 GiB does not fit on it whatever the environment says.
    assert attacker.said() == {"count": 1, "total": CARD, "big": 2, "small": 0}
    assert nvml_view(gpu) == {victim.pid: GIB + CONTEXT, attacker.pid: GIB + CONTEXT}
    assert gpu.stats()["used"] == 2 * GIB and forged.read_bytes() == bytes(4096)  # the forged file was never read or written
    shutil.rmtree(forged.parent)


def test_a_message_cannot_charge_free_or_claim_another_process(gpu: FakeGpu, tenants: list[Tenant]) -> None:
    victim = holder(gpu, tenants, 512 * MIB)
    before = nvml_view(gpu)
    request = fake_gpu.REQUEST.pack(fake_gpu.OP_ALLOC, 0, GIB, 0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as link:
        link.settimeout(10)
        link.connect(str(gpu.socket))
        # Root may put any pid in SCM_CREDENTIALS; the ledger charges the connection's process, and refuses the claim.
        claim = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("<iII", victim.pid, 0, 0))]
        link.sendmsg([request], claim)
        assert struct.unpack_from("<i", link.recv(4096))[0] == fake_gpu.CUDA_ERROR_NOT_PERMITTED
        # Every handle the victim could hold, freed from another connection: none of them is this one's to free.
        answers = set()
        for handle in range(1, 2000):
            link.send(fake_gpu.REQUEST.pack(fake_gpu.OP_FREE, 0, handle, 0))
            answers.add(struct.unpack_from("<i", link.recv(4096))[0])
        assert answers == {fake_gpu.CUDA_ERROR_INVALID_HANDLE}
        # The connection handed to another process (inherited, as a fork or SCM_RIGHTS gives it): its messages are refused.
        link.setblocking(True)  # the descriptor travels with its flags; the relay bounds its own wait
        relay = subprocess.run([SYSTEM_PYTHON, "-c", f"import os, socket, struct; s = socket.socket(fileno={link.fileno()}); s.settimeout(10); "
                                f"s.send(bytes.fromhex('{request.hex()}')); print(struct.unpack_from('<i', s.recv(4096))[0])"],
                               pass_fds=(link.fileno(),), capture_output=True, text=True, timeout=30, check=True)
        assert int(relay.stdout) == fake_gpu.CUDA_ERROR_NOT_PERMITTED
    # Without privilege the kernel itself refuses a pid that is not the sender's.
    unprivileged = Tenant(f"""
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect({str(gpu.socket)!r})
try:
    s.sendmsg([bytes.fromhex('{request.hex()}')], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack('<iII', {victim.pid}, 65534, 65534))])
    say(sent=True)
except PermissionError:
    say(sent=False)
""", env_of(gpu), NOBODY)
    tenants.append(unprivileged)
    assert unprivileged.said() == {"sent": False}
    assert nvml_view(gpu) == before == {victim.pid: 512 * MIB + CONTEXT} and gpu.stats()["used"] == 512 * MIB


def test_closing_or_passing_on_the_ledgers_descriptor_hides_nothing(gpu: FakeGpu, tenants: list[Tenant]) -> None:
    # Closing its link is the driver's teardown: the memory is gone from the card, not hidden on it.
    closer = Tenant("""
context(); rc, _ = alloc(8 << 30); say(rc=rc); wait()
for fd in ledger_fds(): os.close(fd)
say(closed=True); wait()
rc, _ = alloc(1 << 30); say(rc=rc); wait()
""", env_of(gpu), NOBODY)
    tenants.append(closer)
    assert closer.said() == {"rc": 0} and nvml_view(gpu) == {closer.pid: 8 * GIB + CONTEXT}
    assert closer.go() == {"closed": True} and closer.process.poll() is None
    assert nvml_view(gpu) == {} and gpu.stats()["used"] == gpu.stats()["reserved"] == 0
    whole = holder(gpu, tenants, CARD - CONTEXT)  # the whole card is really free again
    assert closer.go()["rc"] != 0  # and the process that closed its link has no GPU left
    whole.stop()
    # A copy of the link kept alive by a child: its memory still goes when the process that opened it dies.
    parent = Tenant("""
context(); rc, _ = alloc(1 << 30)
[link] = ledger_fds(); kept = os.dup(link)
child = os.fork()
if child == 0:
    import time; time.sleep(600)
say(rc=rc, child=child); wait()
""", env_of(gpu))
    tenants.append(parent)
    forked = parent.said()
    assert forked["rc"] == 0 and nvml_view(gpu) == {parent.pid: GIB + CONTEXT}
    os.kill(parent.pid, signal.SIGKILL)
    parent.process.wait()
    child = int(forked["child"])  # type: ignore[arg-type]
    try:
        assert Path(f"/proc/{child}").exists()  # the child still holds the parent's link
        assert nvml_view(gpu) == {} and gpu.stats()["used"] == 0
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_tenant_can_write_no_file_the_ledger_or_nvml_depends_on(gpu: FakeGpu, tenants: list[Tenant]) -> None:
    victim = holder(gpu, tenants, 256 * MIB)
    socket_identity = gpu.socket.stat().st_ino
    attempts = f"""
import shutil
folder = {str(gpu.folder)!r}
tries = {{
    "unlink the socket": lambda: os.unlink(folder + "/fake-gpu.sock"),
    "bind a socket of its own there": lambda: socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).bind(folder + "/fake-gpu.sock"),
    "write the socket": lambda: open(folder + "/fake-gpu.sock", "w"),
    "rewrite the NVML library": lambda: open(folder + "/libnvidia-ml.so.1", "r+b"),
    "replace the driver library": lambda: os.rename(folder + "/libcuda.so.1", folder + "/old"),
    "add a file beside them": lambda: open(folder + "/ledger", "w"),
}}
refused = []
for name, attempt in tries.items():
    try:
        attempt()
    except OSError:
        refused.append(name)
say(refused=refused)
"""
    attacker = Tenant(attempts, env_of(gpu), NOBODY)
    tenants.append(attacker)
    assert len(attacker.said()["refused"]) == 6  # type: ignore[arg-type]
    assert gpu.socket.stat().st_ino == socket_identity and nvml_view(gpu) == {victim.pid: 256 * MIB + CONTEXT}


def test_a_process_in_its_own_pid_namespace_is_charged_by_its_host_pid(gpu: FakeGpu) -> None:
    inside = subprocess.Popen(["unshare", "-Urpf", "--kill-child", "--mount-proc", str(CUPROBE), "init", "ctx", "0", "alloc",
                               str(GIB), "hold", "600000"], env=env_of(gpu), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert inside.stdout is not None
        while "holding" not in inside.stdout.readline():
            pass
        [(pid, held)] = nvml_view(gpu).items()
        assert held == GIB + CONTEXT and pid != 1
        assert f"\t{pid}\t1" in Path(f"/proc/{pid}/status").read_text()  # the host's pid, which is 1 inside its namespace
    finally:
        os.killpg(inside.pid, signal.SIGKILL)
        inside.wait()
    assert exited(pid)  # the namespace's init, killed with its group, ends just after unshare does
    assert nvml_view(gpu) == {} and gpu.stats()["used"] == 0  # a dead process's memory is released


# --- what a real driver spends outside cuMemAlloc, charged to the process ----------------------------


def cubin(globals_bytes: int, code_bytes: int) -> bytes:
    """An ELF64 cubin's headers: a NOBITS .nv.global (no bytes in the file, device memory when loaded) and code."""
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header += struct.pack("<HHIQQQIHHHHHH", 1, 190, 1, 0, 0, 64, 0, 64, 0, 0, 64, 3, 0)
    section = struct.Struct("<IIQQQQIIQQ")
    sections = section.pack(*[0] * 10)
    sections += section.pack(0, 8, 0x3, 0, 0, globals_bytes, 0, 0, 8, 0)  # SHT_NOBITS, SHF_ALLOC | SHF_WRITE
    sections += section.pack(0, 1, 0x6, 0, 0, code_bytes, 0, 0, 128, 0)  # SHT_PROGBITS, SHF_ALLOC | SHF_EXECINSTR
    return header + sections


def test_every_charge_a_real_driver_makes_outside_cumemalloc_is_in_nvmls_process_list(gpu: FakeGpu, tenants: list[Tenant]) -> None:
    image = cubin(32 * MIB, 64 << 10)
    ptx = "//\n// a module as PTX text\n.version 8.0\n.target sm_75\n.address_size 64\n" * 64
    script = f"""
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("where", ctypes.c_int), ("id", ctypes.c_int),
                ("meta", ctypes.c_void_p), ("flags", ctypes.c_uint64)]
class Ipc(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]
say(step="nothing"); wait()
context(); say(step="context"); wait()
assert cu.cuCtxSetLimit(2, 64 << 20) == 0; say(step="heap"); wait()
assert cu.cuCtxSetLimit(0, 2048) == 0; say(step="stack"); wait()
assert cu.cuCtxSetLimit(1, 9 << 20) == 0; say(step="fifo"); wait()
assert cu.cuCtxSetLimit(2, 8 << 20) == 0; say(step="heap back"); wait()
image = bytes.fromhex("{image.hex()}")
module = ctypes.c_void_p(); assert cu.cuModuleLoadData(ctypes.byref(module), image) == 0; say(step="module"); wait()
library = ctypes.c_void_p()
assert cu.cuLibraryLoadData(ctypes.byref(library), {ptx!r}.encode(), None, None, 0, None, None, 0) == 0; say(step="library"); wait()
created = ctypes.c_void_p(); assert cu.cuCtxCreate_v2(ctypes.byref(created), 0, 0) == 0; say(step="created"); wait()
assert cu.cuCtxDestroy_v2(created) == 0 and cu.cuCtxSetCurrent(ctypes.c_void_p(1)) == 0; say(step="destroyed"); wait()
rc, ptr = alloc(100 << 20); handle = Ipc(); assert rc == 0 and cu.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(ptr)) == 0
made = ctypes.c_uint64(); prop = Prop(1, 1, 1, 0, None, 0)
assert cu.cuMemCreate(ctypes.byref(made), ctypes.c_size_t(64 << 20), ctypes.byref(prop), ctypes.c_ulonglong(0)) == 0
fd = ctypes.c_int(); assert cu.cuMemExportToShareableHandle(ctypes.byref(fd), made, 1, ctypes.c_ulonglong(0)) == 0
say(step="exported", ipc=bytes(handle.reserved).hex(), fd=fd.value); wait()
assert cu.cuModuleUnload(module) == 0 and cu.cuLibraryUnload(library) == 0; say(step="unloaded"); wait()
"""
    importer_script = """
class Ipc(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]
context()
ptr = ctypes.c_uint64(); handle = Ipc(); handle.reserved[:] = bytes.fromhex(sys.argv[1])
assert cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, 1) == 0
got = ctypes.c_uint64(); assert cu.cuMemImportFromShareableHandle(ctypes.byref(got), ctypes.c_void_p(int(sys.argv[2])), 1) == 0
say(step="imported"); wait()
assert cu.cuIpcCloseMemHandle(ptr) == 0 and cu.cuMemRelease(got) == 0; say(step="closed"); wait()
"""
    user = Tenant(script, env_of(gpu))
    tenants.append(user)
    expected = {
        "nothing": 0,
        "context": CONTEXT,
        "heap": CONTEXT + 56 * MIB,  # 64 MiB of heap, 8 of it the default the context already has
        "stack": CONTEXT + 56 * MIB + 1024 * fake_gpu.RESIDENT_THREADS,  # 1 KiB more for each resident thread
        "fifo": CONTEXT + 56 * MIB + 40 * MIB + 8 * MIB,
        "heap back": CONTEXT + 40 * MIB + 8 * MIB,  # a limit set again replaces what it charged
        "module": CONTEXT + 48 * MIB + 32 * MIB + (64 << 10),  # its globals and code, though the image holds neither
        "library": CONTEXT + 48 * MIB + 32 * MIB + (64 << 10) + len(ptx) + 1,
    }
    expected["created"] = expected["library"] + CONTEXT  # a context of its own: one more overhead
    expected["destroyed"] = expected["library"]
    steps = [user.said()]
    for step, nbytes in expected.items():
        assert steps[-1]["step"] == step
        assert nvml_view(gpu).get(user.pid, 0) == nbytes, step
        steps.append(user.go())
    assert steps[-1]["step"] == "exported"
    exported = expected["destroyed"] + 100 * MIB + 64 * MIB
    assert nvml_view(gpu)[user.pid] == exported
    fd = os.open(f"/proc/{user.pid}/fd/{steps[-1]['fd']}", os.O_RDONLY)  # the shareable handle, passed on as an fd is
    try:
        importer_tenant = Tenant(importer_script.replace("sys.argv[1]", repr(steps[-1]["ipc"])).replace("sys.argv[2]", repr(str(fd))),
                                 env_of(gpu), pass_fds=(fd,))
    finally:
        os.close(fd)
    tenants.append(importer_tenant)
    assert importer_tenant.said() == {"step": "imported"}
    # The importer is charged what it imported; the card holds those bytes once (they are the exporter's).
    assert nvml_view(gpu) == {user.pid: exported, importer_tenant.pid: CONTEXT + 164 * MIB}
    assert gpu.stats()["used"] == 164 * MIB and gpu.stats(fake_gpu.HOST_SLOT)["used"] == 0  # cuMemCreate on device 0 too
    assert importer_tenant.go() == {"step": "closed"} and nvml_view(gpu)[importer_tenant.pid] == CONTEXT
    assert user.go() == {"step": "unloaded"}
    assert nvml_view(gpu)[user.pid] == exported - 32 * MIB - (64 << 10) - len(ptx) - 1
    # Reserved memory takes room on the card like any other: what the ledger reports, NVML's device view shows.
    stats = gpu.stats()
    assert sum(v or 0 for v in nvml_view(gpu).values()) == stats["used"] + stats["reserved"]


def test_a_limit_that_does_not_fit_is_refused_and_the_old_one_kept(gpu: FakeGpu, tenants: list[Tenant]) -> None:
    hog = holder(gpu, tenants, CARD - 2 * CONTEXT - 16 * MIB)
    user = Tenant("""
context(); value = ctypes.c_size_t()
small = cu.cuCtxSetLimit(2, 16 << 20); big = cu.cuCtxSetLimit(2, 64 << 20); cu.cuCtxGetLimit(ctypes.byref(value), 2)
say(small=small, big=big, kept=value.value); wait()
""", env_of(gpu))
    tenants.append(user)
    # CUDA_ERROR_OUT_OF_MEMORY, as the real driver answers, and the limit stays what it was.
    assert user.said() == {"small": 0, "big": 2, "kept": 16 * MIB}
    assert nvml_view(gpu) == {hog.pid: CARD - CONTEXT - 16 * MIB, user.pid: CONTEXT + 8 * MIB}


# --- the driver's per-cgroup limit (R615) is root's to set -------------------------------------------


@pytest.fixture
def r615() -> Iterator[FakeGpu]:
    """The same on a node whose driver is R615."""
    with readable_gpu(driver_branch=615) as started:
        yield started


@pytest.fixture
def leaf() -> Iterator[Path]:
    """A container's leaf cgroup under the cgroup v2 hierarchy, made for the test."""
    mount = v2_mount()
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy mounted where root can make cgroups")
    top = make_tree(unique_top(mount), "pod/ctr")
    try:
        yield top / "pod" / "ctr"
    finally:
        remove_tree(top)


def test_a_tenant_can_lift_its_own_cgroups_limit_by_no_means(r615: FakeGpu, leaf: Path, tenants: list[Tenant]) -> None:
    assert one(run(r615, "init", "set", leaf, 0, GIB), "set")["rc"] == fake_gpu.NVML_SUCCESS  # root, as the node agent
    script = f"""
class Limits(ctypes.Structure):
    _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong), ("hardLimit", ctypes.c_ulonglong)]
context()
nvml = ctypes.CDLL("libnvidia-ml.so.1"); device = ctypes.c_void_p()
assert nvml.nvmlInit_v2() == 0 and nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device)) == 0
lifted = nvml.nvmlDeviceSetMemoryLimits_v1(device, ctypes.byref(Limits({str(leaf)!r}.encode(), 0, 2**64 - 1)))
# Past NVML: the ledger's own request, naming the tenant's cgroup by a directory it opened.
link = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); link.connect({str(r615.socket)!r})
cgroup = os.open({str(leaf)!r}, os.O_PATH | os.O_DIRECTORY)
link.sendmsg([struct.pack("<IiQQ", {fake_gpu.OP_SET_LIMITS}, 0, 0, 2**64 - 1)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("<i", cgroup))])
raw = struct.unpack_from("<i", link.recv(4096))[0]
# What a managed allocation is told to skip (the limit) it skips as cuMemAllocManaged does: the bytes are still its own.
link.send(struct.pack("<IiQQ", {fake_gpu.OP_ALLOC}, 0, 2 << 30, {fake_gpu.ALLOC_MANAGED}))
managed = struct.unpack_from("<i", link.recv(4096))[0]
big, _ = alloc(2 << 30)
say(lifted=lifted, raw=raw, managed=managed, big=big); wait()
"""
    for prefix in (NOBODY, OWN_USER_NAMESPACE):  # a tenant's uid, and root of a user namespace of its own
        tenant = Tenant(script, env_of(r615), ["sh", "-c", PLACE, str(leaf), *prefix])
        tenants.append(tenant)
        assert tenant.said() == {"lifted": fake_gpu.NVML_ERROR_NO_PERMISSION, "raw": fake_gpu.NVML_ERROR_NO_PERMISSION,
                                 "managed": fake_gpu.CUDA_SUCCESS, "big": fake_gpu.CUDA_ERROR_OUT_OF_MEMORY}
        assert nvml_view(r615)[tenant.pid] == CONTEXT + 2 * GIB  # the enforcer sees the managed bytes as the tenant's
        tenant.stop()
    assert one(run(r615, "init", "get", leaf), "get") == {"rc": fake_gpu.NVML_SUCCESS, "soft": 0, "hard": GIB, "used": 0}
