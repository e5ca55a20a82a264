"""The real kubectl against the sandbox: get, get -w, create -f, label, annotate, describe, delete."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from kai_isolator.services.sandbox.api import SandboxApi
from support import eventually

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")

POD = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "demo", "annotations": {"gpu-memory": "4096"}},
    "spec": {"nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"}, "containers": [{"name": "main", "image": "busybox"}]},
}


async def kubectl(sandbox: SandboxApi, *args: str) -> tuple[int, str]:
    env = {**os.environ, "KUBECONFIG": str(sandbox.settings.kubeconfig), "HOME": str(Path(str(sandbox.settings.kubeconfig)).parent)}
    process = await asyncio.create_subprocess_exec(KUBECTL or "kubectl", *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode()


async def test_kubectl_works_against_the_sandbox(sandbox: SandboxApi, tmp_path: Path) -> None:
    manifest = tmp_path / "pod.json"
    manifest.write_text(json.dumps(POD))
    watcher = await asyncio.create_subprocess_exec(
        KUBECTL or "kubectl", "get", "pods", "-w", "--no-headers", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "KUBECONFIG": str(sandbox.settings.kubeconfig), "HOME": str(tmp_path)},
    )
    try:
        await eventually(lambda: sandbox.store.open_watches >= 2, timeout_s=30)  # node simulator + kubectl
        assert await kubectl(sandbox, "create", "-f", str(manifest), "--validate=false") == (0, "pod/demo created\n")
        await eventually(lambda: sandbox.get("pods", "default", "demo")["status"]["phase"] == "Running")
        code, out = await kubectl(sandbox, "get", "pods", "-o", "wide")
        assert code == 0 and "demo" in out and "Running" in out and "gpu-node-1" in out
        assert (await kubectl(sandbox, "label", "pod", "demo", "team=a"))[0] == 0
        assert (await kubectl(sandbox, "annotate", "pod", "demo", "note=hi"))[0] == 0
        code, out = await kubectl(sandbox, "get", "pods", "-l", "team=a", "-o", "jsonpath={.items[*].metadata.annotations.note}")
        assert (code, out) == (0, "hi")
        code, out = await kubectl(sandbox, "describe", "pod", "demo")
        assert code == 0 and "CUDA_DEVICE_MEMORY_LIMIT" in out and "Successfully assigned default/demo to gpu-node-1" in out
        code, out = await kubectl(sandbox, "get", "configmaps", "-o", "jsonpath={.items[0].data.CUDA_DEVICE_MEMORY_LIMIT}")
        assert (code, out) == (0, "4147m")
        assert (await kubectl(sandbox, "delete", "pod", "demo", "--wait=false"))[0] == 0
        code, out = await kubectl(sandbox, "get", "pod", "demo")
        assert code == 1 and 'pods "demo" not found' in out
        lines: list[str] = []
        assert watcher.stdout is not None
        while len(lines) < 3:
            lines.append((await asyncio.wait_for(watcher.stdout.readline(), 30)).decode())
        assert all(line.startswith("demo") for line in lines)
        assert "Running" in "".join(lines)
    finally:
        watcher.kill()
        await watcher.wait()
