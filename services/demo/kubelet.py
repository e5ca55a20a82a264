"""A demo kubelet: runs a pod's container as a real process in a private mount namespace. DEMO FIXTURE.

It does what matters for isolation the way kubelet does: hostPath volumes (under a temp
host root, never this machine's own paths), `subPath` / `subPathExpr`, read-only mounts,
env from values, the downward API and ConfigMaps. Mount targets are created inside
overlays that live only in the namespace, so this machine's `/etc` is never written.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kai_isolator.shared.errors import IsolatorError

Obj = dict[str, Any]
STARTED = "kai-demo-kubelet: mounts ready"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class ContainerStartError(IsolatorError):
    """The pod cannot start on this node (e.g. a hostPath of type Directory that does not exist)."""


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool


def container_env(pod: Obj, container: Obj, configmaps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as kubelet computes it (values, downward API, ConfigMap keys)."""
    meta = pod.get("metadata") or {}
    fields = {"metadata.uid": meta.get("uid", ""), "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", "")}
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        source = item.get("valueFrom") or {}
        if "value" in item:
            env[item["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), str(item["value"]))
        elif "fieldRef" in source:
            env[item["name"]] = fields.get(source["fieldRef"].get("fieldPath", ""), "")
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = configmaps.get(ref.get("name", ""), {}).get(ref.get("key", ""))
            if value is not None:
                env[item["name"]] = value
    return env


def container_mounts(pod: Obj, container: Obj, env: dict[str, str], host_root: Path) -> list[Mount]:
    """hostPath volume mounts resolved under `host_root`; other volume kinds are not part of the demo."""
    volumes = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
    mounts = []
    for mount in container.get("volumeMounts") or []:
        host_path = (volumes.get(mount.get("name")) or {}).get("hostPath")
        if not host_path:
            continue
        base = host_root / host_path["path"].lstrip("/")
        kind = host_path.get("type", "")
        if kind == "DirectoryOrCreate":
            base.mkdir(parents=True, exist_ok=True)
        elif kind == "Directory" and not base.is_dir():
            raise ContainerStartError(f"hostPath {host_path['path']} is not a directory on this node: the pod waits")
        sub = mount.get("subPath") or _VAR.sub(lambda m: env.get(m.group(1), ""), mount.get("subPathExpr") or "")
        source = base / sub if sub else base
        if mount.get("subPathExpr") and not source.exists():
            source.mkdir(parents=True)
        if not source.exists():
            raise ContainerStartError(f"subPath {sub} does not exist in hostPath {host_path['path']}")
        mounts.append(Mount(source, mount["mountPath"], bool(mount.get("readOnly"))))
    return mounts


def namespace_script(mounts: Sequence[Mount], scratch: Path) -> str:
    """Shell that builds the container's view: overlays on each target's parent, then the bind mounts."""
    lines = []
    for index, parent in enumerate(sorted({os.path.dirname(m.target) for m in mounts})):
        upper, work = scratch / f"upper-{index}", scratch / f"work-{index}"
        upper.mkdir(parents=True)
        work.mkdir()
        for mount in mounts:
            if os.path.dirname(mount.target) == parent:
                point = upper / os.path.basename(mount.target)
                if mount.source.is_dir():
                    point.mkdir()
                else:
                    point.touch()
        lines.append(f"mount -t overlay overlay -o lowerdir={shlex.quote(parent)},upperdir={upper},workdir={work} {shlex.quote(parent)}")
    for mount in mounts:
        lines.append(f"mount --bind {shlex.quote(str(mount.source))} {shlex.quote(mount.target)}")
        if mount.read_only:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(mount.target)}")
    lines.append(f"echo {STARTED}")
    lines.append('exec "$@"')
    return " && ".join(lines)


class Session:
    """A background process group inside a container."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()


class ContainerProcess:
    """One running container: its main process, and `exec` into it like `kubectl exec`."""

    def __init__(self, process: asyncio.subprocess.Process, env: dict[str, str]) -> None:
        self.process = process
        self.env = env

    @property
    def pid(self) -> int:
        """The container's main process (the program itself, after the namespace set-up exec'd it)."""
        return self.process.pid

    async def read_line(self, timeout_s: float = 10) -> str:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
        if not line:
            raise ContainerStartError(f"container exited ({await self.process.wait()}) before printing")
        return line.decode().rstrip("\n")

    async def exec(self, argv: Sequence[str], timeout_s: float = 10) -> str:
        """Run `argv` inside the container's mount namespace with its environment; its output."""
        process = await asyncio.create_subprocess_exec(
            *self._enter(argv), env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        return out.decode()

    async def spawn(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Session:
        """Start `argv` in the container in the background, like a shell session (`env` replaces the container's)."""
        process = await asyncio.create_subprocess_exec(
            *self._enter(argv), env=self.env if env is None else env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        return Session(process)

    def _enter(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-m", "--", *argv]

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
        await self.process.wait()


async def start_container(pod: Obj, container: Obj, argv: Sequence[str], *, configmaps: dict[str, dict[str, str]],
                          host_root: Path, scratch: Path, extra_env: dict[str, str]) -> ContainerProcess:
    """Start `argv` as `container` of `pod`; `extra_env` stands for what the node adds (the GPU driver path)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **extra_env, **container_env(pod, container, configmaps)}
    mounts = container_mounts(pod, container, env, host_root)
    script = namespace_script(mounts, scratch)
    process = await asyncio.create_subprocess_exec(
        "unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    container = ContainerProcess(process, env)
    # exec into the container only once its mounts exist, as kubelet starts the process only then.
    if await container.read_line() != STARTED:
        await container.stop()
        raise ContainerStartError(f"container set-up failed for {argv[0]}")
    return container
