"""`kai-isolator devcluster --real-node`: a Ready node behind kubectl, and after Ctrl-C nothing of it left on the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kai_isolator.services.devcluster.build import ensure_all
from kai_isolator.services.devcluster.realnode import cgroup_hierarchies

BIN = Path(sys.executable).parent


def _mentions(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False


def test_the_command_runs_a_ready_node_and_leaves_nothing_behind(real_node: object, tmp_path: Path) -> None:
    # `real_node` first: the session's node is up (and its programs built) before this second one starts.
    kubeconfig, work = tmp_path / "kubeconfig.yaml", tmp_path / "work"
    links_before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    command = subprocess.Popen([str(BIN / "kai-isolator"), "devcluster", "--real-node", "--kubeconfig", str(kubeconfig), "--workdir", str(work)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert command.stdout is not None
        lines = []
        for line in command.stdout:
            lines.append(line)
            if "Ctrl-C" in line:
                break
        banner = lines[-1]
        assert "real node gpu-node-1 Ready" in banner, "".join(lines)
        done = subprocess.run([str(ensure_all().kubectl), "get", "nodes", "-o", "json"], env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                              capture_output=True, text=True, timeout=30)
        nodes = json.loads(done.stdout)["items"]
        assert [n["metadata"]["name"] for n in nodes] == ["gpu-node-1"]
        assert nodes[0]["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.4.")
        config = json.loads((work / "node" / "kubelet.json").read_text())
        cgroup = config["cgroupRoot"].strip("/")
        assert all((h / cgroup).is_dir() for h in cgroup_hierarchies())
    finally:
        command.send_signal(signal.SIGINT)
        command.wait(timeout=90)
    assert command.returncode == 0
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _mentions(p, str(work))], "a node process outlived the command"
    assert not [h / cgroup for h in cgroup_hierarchies() if (h / cgroup).exists()], "the node's cgroups are still there"
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout.count("kain") <= links_before.count("kain")


def test_flags_for_simulated_nodes_are_refused_with_the_real_node() -> None:
    done = subprocess.run([str(BIN / "kai-isolator"), "devcluster", "--real-node", "--gpu-node", "node-a:24576"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--gpu-node cannot apply" in done.stderr, done
