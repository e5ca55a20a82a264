"""What the node agent's NRI plugin costs and buys at container creation, on the real node (kubelet, containerd 2.4 with
NRI, runc, the R615 fake driver): GPU-sharing pods created one after another with our services at their shipped
defaults, first without NRI (today's watch-driven grant: the baseline), then with the plugin registered. Per mode:
the time from `kubectl apply` to the container running (p50/p99; the plugin's hold for the grant and its cap at start
are in it), and how long the container's first CUDA call waited for its grant (the library's own figure, its INFO line;
0 where the grant was there before the container). Needs root and the real node's build (make real-node). Prints
figures only."""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the real node as the tests run it

from support.pods import cuda_pod  # noqa: E402
from support.real_node import Node, import_cuda_image, is_running, isolated, one_real_node  # noqa: E402

PODS = int(os.environ.get("BENCH_NRI_PODS", "12"))
POLL_S = 0.05
FOUND = re.compile(r"found the grant after (\d+) ms")


def created(node: Node, image: str, name: str) -> tuple[float, float]:
    """One GPU-sharing pod from apply to running, and its first allocation's wait for the grant (ms)."""
    pod = cuda_pod(name, image, 1024, ["cuprobe", "init", "ctx", "0", "alloc", "1048576", "hold", "600000"])
    pod["spec"]["containers"][0]["env"] = [{"name": "LIBCUDA_LOG_LEVEL", "value": "3"}]  # INFO: the library's wait
    began = time.monotonic()
    node.apply_pod(pod)
    while not is_running(node.pod(name)):
        assert time.monotonic() - began < 120, f"{name} not running after 120 s"
        time.sleep(POLL_S)
    running_s = time.monotonic() - began
    deadline = time.monotonic() + 30
    while "alloc 1048576" not in (log := node.kubectl("logs", name, check=False)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "alloc 1048576 rc=0" in log, log
    waited = FOUND.search(log)
    return running_s, float(waited.group(1)) if waited else 0.0


def mode(node: Node, image: str, nri: bool, workdir: Path) -> tuple[list[float], list[float]]:
    running, waits = [], []
    with isolated(node, workdir, nri=nri):
        for index in range(PODS):
            took, waited = created(node, image, f"bench-{'nri' if nri else 'watch'}-{index}")
            running.append(took)
            waits.append(waited)
        node.clean()
    return running, waits


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    if os.geteuid() != 0:
        print("bench/nri_creation.py needs root (the real node)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="kai-bench-nri-") as scratch, one_real_node(Path(scratch) / "node") as node:
        node.real.switch_driver(615)
        image = import_cuda_image(node, Path(scratch) / "images")
        baseline = mode(node, image, False, Path(scratch) / "watch")
        plugin = mode(node, image, True, Path(scratch) / "nri")
    print(f"container creation on the real node, {PODS} GPU-sharing pods per mode, R615 fake driver")
    print(f"{'mode':<34} {'apply->running p50':>19} {'p99':>7} {'first alloc wait p50':>21} {'p99':>8}")
    for name, (running, waits) in (("watch-driven grant (baseline)", baseline), ("NRI plugin (hold + cap)", plugin)):
        print(f"{name:<34} {percentile(running, 50):>17.2f} s {percentile(running, 99):>5.2f} s "
              f"{percentile(waits, 50):>16.0f} ms {percentile(waits, 99):>5.0f} ms")
    print(f"ratio NRI / baseline, apply->running: p50 {percentile(plugin[0], 50) / percentile(baseline[0], 50):.2f}, "
          f"p99 {percentile(plugin[0], 99) / percentile(baseline[0], 99):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
