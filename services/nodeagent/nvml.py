"""The driver's own view of device memory: every GPU's running compute and graphics processes by host
PID and the bytes each holds, read from libnvidia-ml.so.1 with ctypes and the struct layouts of nvml.h."""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass

from kai_isolator.shared.errors import IsolatorError

DEFAULT_LIBRARY = "libnvidia-ml.so.1"

# nvml.h return codes the reader acts on.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1  # (unsigned long long)-1: the driver withholds the figure
_UUID_BUFFER = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE
_RETRIES = 5  # a list that keeps outgrowing its buffer (processes starting) is retried this often


class ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t: what the original entry points fill (16 bytes)."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class ProcessInfoV2(ctypes.Structure):
    """nvmlProcessInfo_v2_t, alias nvmlProcessInfo_t: what _v2 and _v3 fill (24 bytes)."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


assert ctypes.sizeof(ProcessInfoV1) == 16 and ctypes.sizeof(ProcessInfoV2) == 24  # nvml.h, x86_64 and aarch64

# Newest first: (symbol suffix, record layout). _v3 and _v2 share nvmlProcessInfo_t.
_VERSIONS: tuple[tuple[str, type[ctypes.Structure]], ...] = (("_v3", ProcessInfoV2), ("_v2", ProcessInfoV2), ("", ProcessInfoV1))


class NvmlError(IsolatorError):
    """NVML cannot be loaded or a query failed: what it says is then not the whole truth."""


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """One process on one device as the driver reports it; `used_bytes` None: the driver withheld it."""

    pid: int
    device_index: int
    device_uuid: str
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class DriverSnapshot:
    """Every device's processes at one moment; complete, or the reader raised NvmlError instead."""

    processes: tuple[ProcessMemory, ...]
    devices: tuple[str, ...]  # UUIDs by NVML index
    api: str  # the entry points that answered, e.g. "compute_v3+graphics_v3"
    taken_at: float  # time.monotonic()


class Nvml:
    """A loaded and initialised NVML. Thread-safe: queries run in worker threads, one at a time."""

    def __init__(self, library: str = DEFAULT_LIBRARY) -> None:
        try:
            self._lib = ctypes.CDLL(library)
        except OSError as error:
            raise NvmlError(f"cannot load {library}: {error}") from None
        self.library = library
        self._lock = threading.Lock()
        self._chosen: dict[str, tuple[ctypes._CFuncPtr, type[ctypes.Structure], str]] = {}  # type: ignore[name-defined]
        self._room: dict[tuple[str, int], int] = {}
        self._skip: set[str] = set()  # entry points that answered NVML_ERROR_FUNCTION_NOT_FOUND
        init = self._symbol("nvmlInit_v2") or self._symbol("nvmlInit")
        if init is None:
            raise NvmlError(f"{library} has no nvmlInit_v2 or nvmlInit")
        self._check(init(), "nvmlInit_v2")

    def _symbol(self, name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
        try:
            return getattr(self._lib, name)
        except AttributeError:
            return None

    def _error_text(self, code: int) -> str:
        describe = self._symbol("nvmlErrorString")
        if describe is None:
            return f"NVML error {code}"
        describe.restype = ctypes.c_char_p
        text = describe(code)
        return f"{text.decode(errors='replace') if text else 'NVML error'} ({code})"

    def _check(self, code: int, what: str) -> None:
        if code != NVML_SUCCESS:
            raise NvmlError(f"{what}: {self._error_text(code)}")

    def close(self) -> None:
        shutdown = self._symbol("nvmlShutdown")
        if shutdown is not None:
            shutdown()

    # --- queries ---------------------------------------------------------------------------

    def devices(self) -> list[tuple[ctypes.c_void_p, str]]:
        count = ctypes.c_uint()
        get_count = self._symbol("nvmlDeviceGetCount_v2") or self._symbol("nvmlDeviceGetCount")
        get_handle = self._symbol("nvmlDeviceGetHandleByIndex_v2") or self._symbol("nvmlDeviceGetHandleByIndex")
        get_uuid = self._symbol("nvmlDeviceGetUUID")
        if get_count is None or get_handle is None or get_uuid is None:
            raise NvmlError(f"{self.library} lacks the device enumeration entry points")
        self._check(get_count(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        found = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            self._check(get_handle(ctypes.c_uint(index), ctypes.byref(handle)), f"nvmlDeviceGetHandleByIndex_v2({index})")
            uuid = ctypes.create_string_buffer(_UUID_BUFFER)
            self._check(get_uuid(handle, uuid, ctypes.c_uint(_UUID_BUFFER)), f"nvmlDeviceGetUUID({index})")
            found.append((handle, uuid.value.decode(errors="replace")))
        return found

    def snapshot(self) -> DriverSnapshot:
        """Every device's compute and graphics processes. A process in both lists is one process:
        nvml.h says each reports all the memory the application uses, so the larger figure counts."""
        with self._lock:
            held: dict[tuple[int, int], ProcessMemory] = {}
            uuids = []
            apis: set[str] = set()
            for index, (handle, uuid) in enumerate(self.devices()):
                uuids.append(uuid)
                for kind in ("Compute", "Graphics"):
                    records, api = self._running(handle, index, kind)
                    if api:
                        apis.add(api)
                    for pid, used in records:
                        bytes_ = None if used == NVML_VALUE_NOT_AVAILABLE else used
                        key = (pid, index)
                        before = held.get(key)
                        if before is not None and (before.used_bytes is None or (bytes_ is not None and bytes_ <= before.used_bytes)):
                            continue
                        held[key] = ProcessMemory(pid, index, uuid, bytes_)
            return DriverSnapshot(tuple(held.values()), tuple(uuids), "+".join(sorted(apis)), time.monotonic())

    def _running(self, handle: ctypes.c_void_p, index: int, kind: str) -> tuple[list[tuple[int, int]], str]:
        """(pid, used bytes) from nvmlDevice<kind>RunningProcesses, newest entry point first."""
        base = f"nvmlDeviceGet{kind}RunningProcesses"
        while True:
            chosen = self._chosen.get(kind) or self._choose(base, kind)
            if chosen is None:
                if kind == "Graphics":
                    return [], ""  # no graphics entry point at all: a compute-only driver
                raise NvmlError(f"{self.library} has no {base} entry point that answers")
            function, record, name = chosen
            room = self._room.get((kind, index), 16)
            for _ in range(_RETRIES):
                count = ctypes.c_uint(room)
                buffer = (record * room)()
                code = function(handle, ctypes.byref(count), buffer)
                if code == NVML_ERROR_INSUFFICIENT_SIZE:
                    room = count.value + 8  # a few more: processes may start between the calls
                    continue
                break
            else:
                raise NvmlError(f"{name}({index}): the process list kept growing past its buffer")
            if code == NVML_ERROR_FUNCTION_NOT_FOUND:
                self._chosen.pop(kind, None)
                self._skip.add(name)
                continue  # an older driver behind a newer library: the next version down
            if code == NVML_ERROR_NOT_SUPPORTED and kind == "Graphics":
                return [], name  # the device has no graphics contexts to report
            self._check(code, f"{name}({index})")
            self._room[(kind, index)] = max(16, count.value + 8)
            version = name.rpartition("_")[2] if name.endswith(("_v2", "_v3")) else "v1"
            return [(buffer[i].pid, buffer[i].usedGpuMemory) for i in range(count.value)], f"{kind.lower()}_{version}"

    def _choose(self, base: str, kind: str) -> tuple[ctypes._CFuncPtr, type[ctypes.Structure], str] | None:  # type: ignore[name-defined]
        for suffix, record in _VERSIONS:
            name = base + suffix
            function = None if name in self._skip else self._symbol(name)
            if function is None:
                continue
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(record)]
            self._chosen[kind] = (function, record, name)
            return self._chosen[kind]
        return None


# --- per-cgroup memory limits (NVML 13.4, driver R615+) -------------------------------------

NVML_ERROR_NOT_FOUND = 6
MEMORY_LIMIT_MAX = (1 << 64) - 1  # NVML_DEVICE_MEMORY_LIMIT_MAX: "no hard limit"


class SetMemoryLimitsV1(ctypes.Structure):
    """nvmlSetMemoryLimits_v1_t: no version field; nameSpace is the leaf cgroup's full sysfs path."""

    _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong), ("hardLimit", ctypes.c_ulonglong)]


class GetMemoryLimitsV1(ctypes.Structure):
    """nvmlGetMemoryLimits_v1_t."""

    _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong), ("hardLimit", ctypes.c_ulonglong),
                ("currentUsed", ctypes.c_ulonglong)]


@dataclass(frozen=True)
class MemoryLimits:
    """What nvmlDeviceGetMemoryLimits_v1 answered for one device and cgroup."""

    soft_bytes: int
    hard_bytes: int
    used_bytes: int

    @property
    def capped(self) -> bool:
        return self.hard_bytes != MEMORY_LIMIT_MAX


def _limits_call(nvml: Nvml, name: str, record: type[ctypes.Structure]) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    function = nvml._symbol(name)
    if function is not None:
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.POINTER(record)]
    return function


def _handle_of(nvml: Nvml, uuid: str) -> ctypes.c_void_p:
    by_uuid = nvml._symbol("nvmlDeviceGetHandleByUUID")
    if by_uuid is None:
        raise NvmlError(f"{nvml.library} has no nvmlDeviceGetHandleByUUID")
    handle = ctypes.c_void_p()
    nvml._check(by_uuid(uuid.encode(), ctypes.byref(handle)), f"nvmlDeviceGetHandleByUUID({uuid})")
    return handle


def can_limit_memory(nvml: Nvml, uuid: str, probe: str) -> bool:
    """Whether the driver holds per-cgroup limits: it has the entry point and does not answer NOT_SUPPORTED when
    asked about `probe` (any cgroup v2 directory; NOT_FOUND, no limit there, is a driver that can)."""
    get = _limits_call(nvml, "nvmlDeviceGetMemoryLimits_v1", GetMemoryLimitsV1)
    if get is None:
        return False
    with nvml._lock:
        record = GetMemoryLimitsV1(probe.encode(), 0, 0, 0)
        code = get(_handle_of(nvml, uuid), ctypes.byref(record))
    return code not in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)


def set_memory_limit(nvml: Nvml, uuid: str, cgroup: str, hard_bytes: int, soft_bytes: int | None = None) -> None:
    """nvmlDeviceSetMemoryLimits_v1 on the leaf cgroup `cgroup` (full sysfs path); soft defaults to hard, as the
    toolkit's hook does for a limit alone."""
    set_limits = _limits_call(nvml, "nvmlDeviceSetMemoryLimits_v1", SetMemoryLimitsV1)
    if set_limits is None:
        raise NvmlError(f"{nvml.library} has no nvmlDeviceSetMemoryLimits_v1 (a driver before R615)")
    with nvml._lock:
        record = SetMemoryLimitsV1(cgroup.encode(), hard_bytes if soft_bytes is None else soft_bytes, hard_bytes)
        nvml._check(set_limits(_handle_of(nvml, uuid), ctypes.byref(record)), f"nvmlDeviceSetMemoryLimits_v1({uuid}, {cgroup})")


def get_memory_limit(nvml: Nvml, uuid: str, cgroup: str) -> MemoryLimits | None:
    """The limits the driver holds for `cgroup` on the device; None when it holds none (NOT_FOUND)."""
    get = _limits_call(nvml, "nvmlDeviceGetMemoryLimits_v1", GetMemoryLimitsV1)
    if get is None:
        raise NvmlError(f"{nvml.library} has no nvmlDeviceGetMemoryLimits_v1 (a driver before R615)")
    with nvml._lock:
        record = GetMemoryLimitsV1(cgroup.encode(), 0, 0, 0)
        code = get(_handle_of(nvml, uuid), ctypes.byref(record))
        if code == NVML_ERROR_NOT_FOUND:
            return None
        nvml._check(code, f"nvmlDeviceGetMemoryLimits_v1({uuid}, {cgroup})")
        return MemoryLimits(record.softLimit, record.hardLimit, record.currentUsed)
