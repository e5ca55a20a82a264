"""The real node's `nvidia` runtime, run as containerd's shim runs it, with a recording program in runc's place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kai_isolator.services.devcluster import nvidia_runtime

RUNTIME = Path(nvidia_runtime.__file__)


@pytest.fixture
def recorder(tmp_path: Path) -> Path:
    """Stands in for runc: writes down the arguments it was run with."""
    program = tmp_path / "runc"
    program.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'args'}\n")
    program.chmod(0o755)
    return program


def bundle(tmp_path: Path, env: list[str]) -> Path:
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"ociVersion": "1.2.0", "process": {"env": env, "args": ["sleep"]},
                                                    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}]}))
    return folder


def run(recorder: Path, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-I", str(RUNTIME), "--runc", str(recorder), "--driver", "/node/driver", "--", *args],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return (recorder.parent / "args").read_text().splitlines()


def test_a_container_naming_a_gpu_gets_the_driver_and_its_ledger(tmp_path: Path, recorder: Path) -> None:
    env = ["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=GPU-0000fa4e-1111-2222-3333-000000000000", "FAKE_CUDA_STATE=/mine"]
    folder = bundle(tmp_path, env)
    args = ["--root", "/run/containerd/runc/k8s.io", "create", "--bundle", str(folder), "--pid-file", "p", "abc"]
    assert run(recorder, *args) == args
    spec = json.loads((folder / "config.json").read_text())
    binds = {m["destination"]: (m["source"], m["options"]) for m in spec["mounts"] if m["type"] == "bind"}
    assert binds["/usr/lib/x86_64-linux-gnu/libcuda.so.1"] == ("/node/driver/libcuda.so.1", ["bind", "ro", "nosuid", "nodev"])
    assert binds["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"][0] == "/node/driver/libnvidia-ml.so.1"
    assert binds["/usr/bin/nvidia-smi"][0] == "/node/driver/nvidia-smi"
    # The node's ledger, where the libraries look for it (beside themselves), read-only.
    assert binds["/usr/lib/x86_64-linux-gnu/fake-gpu.sock"] == ("/node/driver/fake-gpu.sock", ["bind", "ro", "nosuid", "nodev"])
    # Nothing in the environment: the driver reads none (a FAKE_CUDA_STATE the pod set is inert).
    assert spec["process"]["env"] == env


@pytest.mark.parametrize("devices", [None, "", "void", "none", "NONE"])
def test_a_container_naming_no_gpu_is_left_as_it_is(tmp_path: Path, recorder: Path, devices: str | None) -> None:
    folder = bundle(tmp_path, ["PATH=/usr/bin"] + ([] if devices is None else [f"NVIDIA_VISIBLE_DEVICES={devices}"]))
    before = (folder / "config.json").read_text()
    run(recorder, "create", f"--bundle={folder}", "abc")
    assert (folder / "config.json").read_text() == before


def test_other_commands_pass_through_untouched(tmp_path: Path, recorder: Path) -> None:
    args = ["--root", "/r", "--log-format", "json", "exec", "--process", "/tmp/p.json", "abc"]
    assert run(recorder, *args) == args


def test_bad_usage_is_refused_with_a_message(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-I", str(RUNTIME), "create"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage:" in done.stderr


def test_an_exec_is_passed_through_untouched(tmp_path: Path, recorder: Path) -> None:
    # The exec'd process sees the container's mounts, the ledger's socket among them: nothing to add.
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["nvidia-smi"], "env": ["PATH=/usr/bin"]}))
    args = ["--root", "/r", "exec", "--process", str(process), "--detach", "abc"]
    assert run(recorder, *args) == args
    assert json.loads(process.read_text())["env"] == ["PATH=/usr/bin"]
