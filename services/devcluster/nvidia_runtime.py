"""The real node's `nvidia` runtime: runc, plus the (fake) driver in containers whose environment names GPUs.

Like nvidia-container-runtime: on `create` it reads the bundle's OCI config and, when NVIDIA_VISIBLE_DEVICES names
GPUs (not empty, `void` or `none`), adds the driver's libraries, `nvidia-smi` and the driver's node-wide ledger as
read-only binds (the ledger read-write: the fake driver keeps its books there), and on `exec` into such a container
names the ledger in the new process's env too; then runs runc as asked.
Standard library only: containerd's shim runs it as `python3 -I nvidia_runtime.py --runc R --driver D -- ARGS`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LIBRARY_DIR = "/usr/lib/x86_64-linux-gnu"
LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")
SMI = "/usr/bin/nvidia-smi"
LEDGER = "/run/nvidia-fake-driver/ledger"  # in the container; FAKE_CUDA_STATE names it
SOCKET = "fake-gpu.sock"
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
    """The driver's files into the spec, as binds; FAKE_CUDA_STATE pointing at its ledger."""
    mounts: list[dict[str, object]] = spec.setdefault("mounts", [])  # type: ignore[assignment]
    read_only = ["bind", "ro", "nosuid", "nodev"]
    for name in LIBRARIES:
        mounts.append({"destination": f"{LIBRARY_DIR}/{name}", "type": "bind", "source": str(driver / name), "options": read_only})
    mounts.append({"destination": SMI, "type": "bind", "source": str(driver / "nvidia-smi"), "options": read_only})
    mounts.append({"destination": LEDGER, "type": "bind", "source": str(driver / "ledger"), "options": ["bind", "rw", "nosuid", "nodev", "noexec"]})
    if (driver / SOCKET).exists():  # a driver that keeps its books in a daemon: the libraries find it next to them
        mounts.append({"destination": f"{LIBRARY_DIR}/{SOCKET}", "type": "bind", "source": str(driver / SOCKET), "options": read_only})
    process: dict[str, object] = spec.setdefault("process", {})  # type: ignore[assignment]
    env: list[str] = process.setdefault("env", [])  # type: ignore[assignment]
    env[:] = [e for e in env if not e.startswith("FAKE_CUDA_STATE=")] + [f"FAKE_CUDA_STATE={LEDGER}"]


def option(args: list[str], command: str, name: str) -> str | None:
    """The value of `--name V` or `--name=V` after `command` in runc's arguments."""
    rest = args[args.index(command) + 1:]
    for i, arg in enumerate(rest):
        if arg == name and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def exec_gets_ledger(runc: str, args: list[str]) -> None:
    """`runc exec --process P ID` into a container that has the driver: P's env names the ledger too. containerd builds an
    exec's process from its own copy of the container's spec, which never saw what `create` added to config.json."""
    process_file = option(args, "exec", "--process")
    if process_file is None:
        return
    state = subprocess.run([runc, *args[:args.index("exec")], "state", args[-1]], capture_output=True, text=True, timeout=30)
    try:
        spec = json.loads((Path(json.loads(state.stdout)["bundle"]) / "config.json").read_text())
    except (ValueError, KeyError, TypeError, OSError):
        return  # no such container, or no bundle: runc's exec reports that itself
    if not any(m.get("destination") == LEDGER for m in spec.get("mounts") or []):
        return
    process = json.loads(Path(process_file).read_text())
    env: list[str] = process.setdefault("env", [])
    env[:] = [e for e in env if not e.startswith("FAKE_CUDA_STATE=")] + [f"FAKE_CUDA_STATE={LEDGER}"]
    Path(process_file).write_text(json.dumps(process))


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[0] != "--runc" or argv[2] != "--driver" or argv[4] != "--":
        print("usage: nvidia_runtime.py --runc RUNC --driver DIR -- RUNC-ARGS...", file=sys.stderr)
        return 2
    runc, driver, args = argv[1], Path(argv[3]), argv[5:]
    if "exec" in args:
        exec_gets_ledger(runc, args)
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
