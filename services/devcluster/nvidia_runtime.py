"""The real node's `nvidia` runtime: runc, plus the (fake) driver in containers whose environment names GPUs.

Like nvidia-container-runtime: on `create` it reads the bundle's OCI config and, when NVIDIA_VISIBLE_DEVICES names
GPUs (not empty, `void` or `none`), adds the driver's libraries, `nvidia-smi` and the socket of the node's fake-gpu
ledger (`fake-gpu.sock`, beside the libraries, where they look for it) as read-only binds; then runs runc as asked.
Nothing goes into the container's environment: the driver needs none, and an `exec` sees the same mounts.
Standard library only: containerd's shim runs it as `python3 -I nvidia_runtime.py --runc R --driver D -- ARGS`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LIBRARY_DIR = "/usr/lib/x86_64-linux-gnu"
LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")
SMI = "/usr/bin/nvidia-smi"
SOCKET = "fake-gpu.sock"  # the node's fake-gpu ledger (kai_isolator.services.devcluster.fake_gpu_ledger), found beside the libraries
NO_GPUS = ("", "void", "none")


def bundle_of(args: list[str]) -> Path | None:
    """The bundle of a `create` (`runc [global flags] create --bundle B ID`), None for any other command."""
    if "create" not in args:
        return None
    rest = args[args.index("create") + 1:]
    for i, arg in enumerate(rest):
        if arg in ("--bundle", "-b") and i + 1 < len(rest):
            return Path(rest[i + 1])
        if arg.startswith("--bundle="):
            return Path(arg.split("=", 1)[1])
    return Path.cwd()  # runc's default bundle


def wants_gpus(spec: dict[str, object]) -> bool:
    env = (spec.get("process") or {}).get("env") or []  # type: ignore[union-attr]
    values = [e.split("=", 1)[1] for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    return bool(values) and values[-1].strip().lower() not in NO_GPUS


def add_driver(spec: dict[str, object], driver: Path) -> None:
    """The driver's files into the spec, as read-only binds: its libraries, nvidia-smi, and its ledger's socket.
    The socket is bound whether or not it exists yet: a node whose GPU is not up fails the container, loudly,
    rather than giving it a driver without the node's books."""
    mounts: list[dict[str, object]] = spec.setdefault("mounts", [])  # type: ignore[assignment]
    read_only = ["bind", "ro", "nosuid", "nodev"]
    for name in LIBRARIES:
        mounts.append({"destination": f"{LIBRARY_DIR}/{name}", "type": "bind", "source": str(driver / name), "options": read_only})
    mounts.append({"destination": SMI, "type": "bind", "source": str(driver / "nvidia-smi"), "options": read_only})
    mounts.append({"destination": f"{LIBRARY_DIR}/{SOCKET}", "type": "bind", "source": str(driver / SOCKET), "options": read_only})


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[0] != "--runc" or argv[2] != "--driver" or argv[4] != "--":
        print("usage: nvidia_runtime.py --runc RUNC --driver DIR -- RUNC-ARGS...", file=sys.stderr)
        return 2
    runc, driver, args = argv[1], Path(argv[3]), argv[5:]
    bundle = bundle_of(args)
    if bundle is not None:
        config = bundle / "config.json"
        spec = json.loads(config.read_text())
        if wants_gpus(spec):
            add_driver(spec, driver)
            config.write_text(json.dumps(spec))
    os.execv(runc, [runc, *args])
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
