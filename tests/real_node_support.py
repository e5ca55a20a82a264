"""What the real-node tests share: the node and its cluster as a test drives them (kubectl), and the loop they run on."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.services.devcluster.realcluster import RealNodeCluster
from kai_isolator.services.devcluster.realnode import RealNode

HAMI_BUILD = Path(__file__).resolve().parents[1] / "hami-core" / "build"
CUDA_IMAGE = "docker.io/nvidia/cuda:12.9.2-base-ubuntu24.04"


class LoopThread:
    """An event loop of its own in a daemon thread: the cluster's webhooks and informers run there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="real-node-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Any, timeout_s: float) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Node:
    """The running real node and its cluster, for tests: kubectl as the admin, the node's own view, its phases."""

    real: RealNodeCluster
    loop: LoopThread
    made: list[tuple[str, str]] = field(default_factory=list)

    @property
    def plane(self) -> ControlPlane:
        assert self.real.cluster is not None and self.real.cluster.plane is not None
        return self.real.cluster.plane

    @property
    def node(self) -> RealNode:
        assert self.real.node is not None
        return self.real.node

    def kubectl(self, *args: str, input_text: str | None = None, check: bool = True, timeout_s: float = 60) -> str:
        return self.plane.kubectl(*args, input_text=input_text, check=check, timeout_s=timeout_s).stdout

    def apply_pod(self, pod: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
        self.made.append((pod["metadata"].get("namespace", "default"), pod["metadata"]["name"]))

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return json.loads(self.kubectl("get", "pod", name, "-n", namespace, "-o", "json"))  # type: ignore[no-any-return]

    def wait_running(self, name: str, namespace: str = "default", timeout_s: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            pod = self.pod(name, namespace)
            if pod["status"].get("phase") == "Running" and all(s.get("ready") for s in pod["status"].get("containerStatuses", [])):
                return pod
            if pod["status"].get("phase") in ("Failed", "Succeeded") or time.monotonic() > deadline:
                events = self.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}", check=False)
                raise AssertionError(f"pod {namespace}/{name} not running: {json.dumps(pod['status'], indent=1)}\n{events}")
            time.sleep(0.2)

    def clean(self) -> None:
        for namespace, name in self.made:
            self.kubectl("delete", "pod", name, "-n", namespace, "--ignore-not-found", "--grace-period=0", "--force", "--wait=true",
                         check=False, timeout_s=60)
        self.made.clear()
