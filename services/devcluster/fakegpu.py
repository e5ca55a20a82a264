"""The real node's GPU, faked at the driver level only, the way a GPU Operator cluster looks to Kubernetes.

hami-core's fake `libcuda.so.1` / `libnvidia-ml.so.1` and its `nvidia-smi` stand-in are the driver, installed once
into the node's driver folder; the node-wide ledger (the ground truth) is a node process, fake_gpu_ledger.py beside this file,
serving `fake-gpu.sock` in that folder, where the libraries find it; the `nvidia` runtime
(nvidia_runtime.py) adds them to containers that name GPUs; a device plugin advertises `nvidia.com/gpu` through
the kubelet's device-plugin API (gRPC, v1beta1) and hands out NVIDIA_VISIBLE_DEVICES; the node carries the labels
GPU feature discovery sets. A DEV AND TEST FIXTURE.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from .fake_gpu_ledger import SOCKET_NAME
from .fake_gpu_ledger import FakeGpu as Ledger
from .kai import fake_gpu_uuid
from .realnode import RUNC, compiled

HAMI_BUILD = Path(__file__).resolve().parents[2] / "hami-core" / "build"
RUNTIME_SOURCE = Path(__file__).resolve().parent / "nvidia_runtime.py"
SMI_SOURCE = Path(__file__).resolve().parent / "node" / "nvidia-smi.c"  # nvidia-smi's table, from NVML
RESOURCE = "nvidia.com/gpu"
API_VERSION = "v1beta1"
PLUGIN_SOCKET = "kai-isolator-fake-gpu.sock"
REGISTER_TIMEOUT_S = 10.0
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"  # fixed by the API; the node's own (its /var/lib is the work dir's)


class FakeGpuError(RuntimeError):
    """The fake driver is not built, or the kubelet refused the device plugin."""


# --- the device-plugin API's few messages, in protobuf's wire format -------------------------------

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _string(number: int, text: str) -> bytes:
    return _bytes_field(number, text.encode())


def _fields(data: bytes) -> Iterator[tuple[int, bytes | int]]:
    """(field number, value) of a message: bytes for length-delimited fields, int for varints."""
    at = 0

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while at < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, varint()
        elif wire == 2:
            size = varint()
            yield number, data[at:at + size]
            at += size
        else:
            raise ValueError(f"protobuf wire type {wire} in a device-plugin message")


def register_request(endpoint: str) -> bytes:
    """RegisterRequest{version, endpoint, resource_name, options{}}."""
    return _string(1, API_VERSION) + _string(2, endpoint) + _string(3, RESOURCE) + _bytes_field(4, b"")


def list_response(device_ids: list[str]) -> bytes:
    """ListAndWatchResponse{devices: [Device{ID, health}]}."""
    return b"".join(_bytes_field(1, _string(1, d) + _string(2, "Healthy")) for d in device_ids)


def allocate_response(request: bytes) -> bytes:
    """AllocateResponse: per container, NVIDIA_VISIBLE_DEVICES = the devices the kubelet chose (the envvar strategy)."""
    responses = b""
    for number, container in _fields(request):
        if number != 1 or not isinstance(container, bytes):
            continue
        ids = [value.decode() for n, value in _fields(container) if n == 1 and isinstance(value, bytes)]
        entry = _string(1, "NVIDIA_VISIBLE_DEVICES") + _string(2, ",".join(ids))
        responses += _bytes_field(1, _bytes_field(1, entry))
    return responses


class DevicePlugin:
    """nvidia.com/gpu for the kubelet: serves DevicePlugin on a socket in its device-plugins folder, then registers."""

    def __init__(self, folder: Path, device_ids: list[str]) -> None:
        self.folder = folder
        self.device_ids = device_ids
        self._stopped = threading.Event()
        self._server: grpc.Server | None = None

    def _list_and_watch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield list_response(self.device_ids)
        while not self._stopped.wait(1.0) and context.is_active():
            pass  # the devices never change; the stream stays open, as the kubelet expects

    def start(self) -> None:
        identity = lambda data: data  # noqa: E731 - messages travel as the bytes built above
        unary = lambda handler: grpc.unary_unary_rpc_method_handler(handler, identity, identity)  # noqa: E731
        handlers = {
            "GetDevicePluginOptions": unary(lambda request, context: b""),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(self._list_and_watch, identity, identity),
            "Allocate": unary(lambda request, context: allocate_response(request)),
            "GetPreferredAllocation": unary(lambda request, context: b""),
            "PreStartContainer": unary(lambda request, context: b""),
        }
        socket = self.folder / PLUGIN_SOCKET
        socket.unlink(missing_ok=True)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fake-gpu-plugin"))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(f"{API_VERSION}.DevicePlugin", handlers),))
        self._server.add_insecure_port(f"unix://{socket}")
        self._server.start()
        with grpc.insecure_channel(f"unix://{self.folder / 'kubelet.sock'}") as channel:
            register = channel.unary_unary(f"/{API_VERSION}.Registration/Register", request_serializer=identity, response_deserializer=identity)
            try:
                register(register_request(PLUGIN_SOCKET), timeout=REGISTER_TIMEOUT_S)
            except grpc.RpcError as error:
                raise FakeGpuError(f"the kubelet refused the device plugin: {error}") from None

    def stop(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.stop(grace=1).wait(5)
            self._server = None


class FakeGpu:
    """One fake T4 for one node: its driver folder, `nvidia` runtime, device plugin, RuntimeClass and labels."""

    def __init__(self, workdir: Path, memory_mib: int, count: int = 1, driver_branch: int = 580) -> None:
        self.workdir = workdir
        self.memory_mib = memory_mib
        self.count = count
        # The driver branch the ledger answers as: 580 has no per-cgroup memory limits, 615 has NVML 13.4's.
        self.driver_branch = driver_branch
        self.driver = workdir / "driver"
        self.runtime = workdir / "nvidia-container-runtime"

    @property
    def ledger_socket(self) -> Path:
        """Where the node's ledger listens: beside the libraries, where they look for it."""
        return self.driver / SOCKET_NAME

    def prepare(self, cache: Path) -> None:
        """Install the driver (a copy, so rebuilding hami-core does not change a running node) and the runtime."""
        sources = {"libcuda.so.1": HAMI_BUILD / "fake" / "libcuda.so.1", "libnvidia-ml.so.1": HAMI_BUILD / "fake" / "libnvidia-ml.so.1"}
        missing = [str(p) for p in sources.values() if not p.is_file()]
        if missing:
            raise FakeGpuError(f"the fake driver is not built ({', '.join(missing)}): run `make hami-core`")
        sources["nvidia-smi"] = compiled(SMI_SOURCE, cache, f"-L{HAMI_BUILD / 'fake'}", "-l:libnvidia-ml.so.1")
        self.driver.mkdir(parents=True, exist_ok=True)
        for name, source in sources.items():
            shutil.copy2(source, self.driver / name)
        (self.driver / "ledger").unlink(missing_ok=True)  # the books live in the ledger process, never in a file
        self.runtime.write_text(f"#!/bin/sh\nexec {sys.executable} -I {RUNTIME_SOURCE} --runc {RUNC} --driver {self.driver} -- \"$@\"\n")
        self.runtime.chmod(0o755)

    def labels(self) -> dict[str, str]:
        """What GPU feature discovery labels a T4 node with."""
        return {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.memory": str(self.memory_mib),
                "nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.count": str(self.count)}

    @staticmethod
    def runtime_class() -> dict[str, Any]:
        return {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"}, "handler": "nvidia"}

    def ledger_command(self) -> list[str]:
        """The node's ledger as the node runs it (a process in the node's namespaces, as the kernel driver is the node's)."""
        return Ledger(self.driver, devices=self.count, total_mib=self.memory_mib, driver_branch=self.driver_branch).command()

    def device_plugin_command(self) -> list[str]:
        """The device plugin as the node runs it (a process in the node's namespaces, as a DaemonSet's pod would be)."""
        devices = [f"--device={fake_gpu_uuid(i)}" for i in range(self.count)]
        return [sys.executable, "-m", "kai_isolator.services.devcluster.fakegpu", f"--folder={DEVICE_PLUGIN_DIR}", *devices]


def serve(folder: Path, device_ids: list[str]) -> int:
    """Run the device plugin until SIGTERM, registering again whenever the kubelet comes back (a new kubelet.sock)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signo, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signo, frame: stop.set())
    plugin = DevicePlugin(folder, device_ids)
    kubelet = folder / "kubelet.sock"
    registered_with = None
    try:
        while not stop.wait(0 if registered_with is None else 1.0):
            current = kubelet.stat().st_ino if kubelet.exists() else None
            if current is not None and current != registered_with:
                plugin.stop()
                plugin = DevicePlugin(folder, device_ids)
                plugin.start()
                registered_with = current
                print(f"fake GPU device plugin: {RESOURCE} x{len(device_ids)} registered with the kubelet", flush=True)
    finally:
        plugin.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fakegpu", description="the real node's fake GPU device plugin (dev/test fixture)")
    parser.add_argument("--folder", type=Path, default=Path(DEVICE_PLUGIN_DIR), help="the kubelet's device-plugin folder")
    parser.add_argument("--device", dest="devices", action="append", required=True, help="a GPU's UUID (repeatable)")
    args = parser.parse_args(argv)
    return serve(args.folder, args.devices)


if __name__ == "__main__":
    sys.exit(main())
