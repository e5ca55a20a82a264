"""A demo kubelet: runs a pod's container as a real process in a private mount namespace. DEMO FIXTURE.

It does what matters for isolation the way kubelet does: hostPath volumes (under a temp
host root, never this machine's own paths), `subPath` / `subPathExpr`, read-only mounts,
env from values, the downward API and ConfigMaps, and a cgroup named as the kubelet names
it (pod uid and container id in the path) that the container and every `exec` into it join.
Mount targets are created inside overlays that live only in the namespace, so this
machine's `/etc` is never written; cgroups live under a prefix unique to this kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shlex
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kai_isolator.shared.cgroups import CgroupDriver, container_id_from_status, kubelet_cgroup_path
from kai_isolator.shared.errors import IsolatorError

Obj = dict[str, Any]
STARTED = "kai-demo-kubelet: mounts ready"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 hierarchies a process may join without limiting it (never memory or cpu: they would
# constrain the test machine's own processes), then the v2 one of a hybrid host.
_V1_HIERARCHIES = ("pids", "freezer")
# Joins each cgroup named before `--`, then execs the rest, as a runtime places a process
# before it runs the container's program.
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@"'


class ContainerStartError(IsolatorError):
    """The pod cannot start on this node (e.g. a hostPath of type Directory that does not exist)."""


def cgroup_hierarchies(root: Path = CGROUP_ROOT) -> tuple[Path, ...]:
    """Writable hierarchies to place containers in: the v2 one (pure or hybrid) and harmless v1 ones."""
    found = [root] if (root / "cgroup.controllers").exists() else []
    found += [root / "unified"] if (root / "unified" / "cgroup.controllers").exists() else []
    found += [root / name for name in _V1_HIERARCHIES if (root / name / "cgroup.procs").exists()]
    return tuple(path for path in found if os.access(path, os.W_OK))


@dataclass
class CgroupPlacement:
    """Where this kubelet puts containers: `<hierarchy>/<prefix>/<kubelet's path>` in each hierarchy.

    The prefix keeps concurrent kubelets (tests, demos) apart; the node agent reads the path from
    its first pod component on (pod, container), as under a real kubelet's own parent.
    """

    prefix: str = field(default_factory=lambda: f"kai-demo-{secrets.token_hex(6)}")
    driver: CgroupDriver = CgroupDriver.CGROUPFS
    hierarchies: tuple[Path, ...] = field(default_factory=cgroup_hierarchies)
    created: list[Path] = field(default_factory=list)

    def create(self, pod_uid: str, container_id: str) -> list[Path]:
        """The container's cgroup in every hierarchy, made now (parents too)."""
        relative = kubelet_cgroup_path(pod_uid, container_id, driver=self.driver)
        made = []
        for hierarchy in self.hierarchies:
            path = hierarchy / self.prefix / relative
            path.mkdir(parents=True, exist_ok=True)
            self.created.append(path)
            made.append(path)
        return made

    def place(self, pid: int, pod_uid: str, container_id: str) -> list[Path]:
        """Move a running process (and so its future children) into the container's cgroup."""
        made = self.create(pod_uid, container_id)
        for path in made:
            (path / "cgroup.procs").write_text(str(pid))
        return made

    def remove(self, timeout_s: float = 10) -> None:
        """Kill what is left in our cgroups and remove them, deepest first, up to the prefix."""
        for hierarchy in self.hierarchies:
            top = hierarchy / self.prefix
            if not top.exists():
                continue
            for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [top]:
                _empty_and_remove(path, timeout_s)
        self.created.clear()


def _empty_and_remove(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # a killed process leaves its cgroup only once it is reaped


def new_container_id() -> str:
    """A container id as containerd makes one: 64 hex digits."""
    return secrets.token_hex(32)


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


def namespace_script(mounts: Sequence[Mount], scratch: Path, cgroups: Sequence[Path] = ()) -> str:
    """Shell that builds the container's view: overlays on each target's parent, then the bind
    mounts; then it joins the container's cgroups, so that its first process there is the program."""
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
    lines.extend(f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))}" for cgroup in cgroups)
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

    def __init__(self, process: asyncio.subprocess.Process, env: dict[str, str], container_id: str = "",
                 cgroups: Sequence[Path] = ()) -> None:
        self.process = process
        self.env = env
        self.container_id = container_id
        self.cgroups = list(cgroups)

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
            *self.inside(argv), env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        return out.decode()

    async def spawn(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Session:
        """Start `argv` in the container in the background, like a shell session (`env` replaces the container's)."""
        process = await asyncio.create_subprocess_exec(
            *self.inside(argv), env=self.env if env is None else env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        return Session(process)

    def inside(self, argv: Sequence[str]) -> list[str]:
        """`argv` as a command line that runs it inside the container (its namespace and cgroup)."""
        # Like `kubectl exec`: into the namespace first, then the cgroup, then the program, so
        # nothing in the container's cgroup ever runs outside its mounts.
        return ["nsenter", "-t", str(self.pid), "-m", "--", *joined(self.cgroups, argv)]

    def pids(self) -> list[int]:
        """Every process now in the container's cgroup (its main process, execs and their children)."""
        if not self.cgroups:
            return [self.pid]
        try:
            return sorted(int(pid) for pid in (self.cgroups[0] / "cgroup.procs").read_text().split())
        except OSError:
            return []

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
        await self.process.wait()
        for pid in self.pids():  # what was exec'd into the container stops with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def joined(cgroups: Sequence[Path], argv: Sequence[str]) -> list[str]:
    """`argv`, started inside `cgroups` (unchanged when there are none)."""
    if not cgroups:
        return list(argv)
    return ["sh", "-c", _JOIN, "sh", *map(str, cgroups), "--", *argv]


def pod_container_id(pod: Obj, container: str) -> str:
    """The runtime id `status.containerStatuses` gives `container`, if it is a real one (64 hex digits)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            found = container_id_from_status(status.get("containerID") or "")
            if re.fullmatch(r"[0-9a-f]{64}", found):
                return found
    return ""


async def start_container(pod: Obj, container: Obj, argv: Sequence[str], *, configmaps: dict[str, dict[str, str]],
                          host_root: Path, scratch: Path, extra_env: dict[str, str],
                          placement: CgroupPlacement | None = None) -> ContainerProcess:
    """Start `argv` as `container` of `pod`; `extra_env` stands for what the node adds (the GPU driver path).

    With a `placement`, the container runs in a cgroup named as the kubelet names it, with
    the id `status.containerStatuses` gives it (or a new one).
    """
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **extra_env, **container_env(pod, container, configmaps)}
    mounts = container_mounts(pod, container, env, host_root)
    container_id = pod_container_id(pod, container.get("name", "")) or new_container_id()
    uid = (pod.get("metadata") or {}).get("uid", "")
    cgroups = placement.create(uid, container_id) if placement is not None and uid else []
    script = namespace_script(mounts, scratch, cgroups)
    process = await asyncio.create_subprocess_exec(
        "unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    container = ContainerProcess(process, env, container_id, cgroups)
    # exec into the container only once its mounts exist, as kubelet starts the process only then.
    if await container.read_line() != STARTED:
        await container.stop()
        raise ContainerStartError(f"container set-up failed for {argv[0]}")
    return container
