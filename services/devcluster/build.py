"""Builds the local control plane (etcd, kube-apiserver, kubectl), promtool, and for the real node its kubelet,
runtime and CNI plugin, from the pinned Go modules in `go/`, once.

The binaries land in a cache outside the repo (`~/.cache/kai-isolator/kube/<component>-<version>-<digest>/`),
keyed by the module files, so a second run, or another checkout, reuses them. `python -m kai_isolator.services.devcluster.build`
builds what is missing and prints the paths (`--real-node` adds the node's programs); `make test` runs it first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

MODULES = Path(__file__).resolve().parent / "go"
PROGRESS_EVERY_S = 20.0


class BuildError(RuntimeError):
    """The control plane could not be built: no Go toolchain, a module that does not build, a missing file."""


@dataclass(frozen=True)
class Component:
    """One Go module folder and the programs built from it."""

    name: str
    folder: Path
    module: str  # the module whose version names the cache entry
    packages: tuple[str, ...]  # package paths for `go build`, relative to the folder
    tags: str = ""  # `go build -tags`
    cgo: bool = True

    @property
    def version(self) -> str:
        text = (self.folder / "go.mod").read_text()
        found = re.search(rf"^(?:require)?\s*{re.escape(self.module)} (v\S+)(?: // indirect)?$", text, re.M)
        if found is None:
            raise BuildError(f"{self.folder / 'go.mod'}: no `require {self.module} vX.Y.Z` line")
        return found.group(1)

    def ldflags(self) -> str:
        flags = ["-s", "-w"]
        if self.module == "k8s.io/kubernetes":
            # What hack/lib/version.sh stamps: without it the binaries call themselves v0.0.0-master.
            major, minor = self.version.lstrip("v").split(".")[:2]
            for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
                flags += [f"-X {package}.gitVersion={self.version}", f"-X {package}.gitMajor={major}",
                          f"-X {package}.gitMinor={minor}", f"-X {package}.gitTreeState=clean"]
        elif self.module == "github.com/docker/compose/v2":
            flags.append(f"-X {self.module}/internal.Version={self.version}")  # what its Makefile stamps
        elif self.module == "github.com/containerd/containerd/v2":
            flags.append(f"-X {self.module}/version.Version={self.version}")
        return " ".join(flags)

    def digest(self) -> str:
        """What the binaries depend on besides the toolchain: the module files, sources and flags."""
        # Tags and cgo enter only when set, so the entries built before they existed keep their names.
        sha = hashlib.sha256(self.ldflags().encode() + (f"\0{self.tags}\0{self.cgo}".encode() if self.tags or not self.cgo else b""))
        for path in sorted(self.folder.iterdir()):
            if path.is_file():
                sha.update(path.name.encode() + b"\0" + path.read_bytes())
        return sha.hexdigest()[:12]

    def tag_flags(self) -> list[str]:
        return ["-tags", self.tags] if self.tags else []

    def programs(self) -> list[str]:
        """The executables `go build -o dir/` writes: each package's last path element that is not a major version."""
        return [self.name if p == "." else _program_name(p) for p in self.packages]


def _program_name(package: str) -> str:
    parts = package.split("/")
    if re.fullmatch(r"v[2-9][0-9]*", parts[-1]):
        parts.pop()
    return parts[-1]


ETCD = Component("etcd", MODULES / "etcd", "go.etcd.io/etcd/server/v3", (".",))
KUBE = Component("kubernetes", MODULES / "apiserver", "k8s.io/kubernetes",
                 ("k8s.io/kubernetes/cmd/kube-apiserver", "k8s.io/kubernetes/cmd/kubectl"))
# remove_all_sd leaves out Prometheus' cloud service discoveries, which checking and unit-testing rules never
# use: a fifth fewer packages to compile.
PROMTOOL = Component("promtool", MODULES / "promtool", "github.com/prometheus/prometheus",
                     ("github.com/prometheus/prometheus/cmd/promtool",), tags="remove_all_sd")
# The real node's programs. The same Kubernetes release as KUBE, from a module folder of its own so that adding
# them leaves KUBE's cache entry (and `make run`, which needs only KUBE) untouched; the Go build cache still
# shares every package the two have in common.
KUBELET = Component("kubelet", MODULES / "node", "k8s.io/kubernetes", ("k8s.io/kubernetes/cmd/kubelet",))
KUBE_CONTROLLERS = Component("kube-controllers", MODULES / "node", "k8s.io/kubernetes",
                             ("k8s.io/kubernetes/cmd/kube-controller-manager", "k8s.io/kubernetes/cmd/kube-scheduler"))
# containerd's storage drivers that need C libraries are left out, as its static release builds do.
CONTAINERD = Component("containerd", MODULES / "containerd", "github.com/containerd/containerd/v2",
                       ("github.com/containerd/containerd/v2/cmd/containerd",
                        "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
                        "github.com/containerd/containerd/v2/cmd/ctr"),
                       tags="no_btrfs no_devmapper no_zfs", cgo=False)
# kube-proxy (iptables mode, in the node's network namespace) gives Services their ClusterIPs on the node, as on
# every cluster: pods reach the API server at the `kubernetes` Service and the bus at its Service. A module folder
# of its own, so the node's other entries stay valid; the Go build cache shares the packages it has with the kubelet.
KUBE_PROXY = Component("kube-proxy", MODULES / "proxy", "k8s.io/kubernetes", ("k8s.io/kubernetes/cmd/kube-proxy",))
CNI = Component("cni-plugins", MODULES / "cni", "github.com/containernetworking/plugins",
                tuple(f"github.com/containernetworking/plugins/plugins/{p}" for p in ("main/loopback", "main/ptp", "ipam/host-local")), cgo=False)
COMPONENTS = (ETCD, KUBE, PROMTOOL)
NODE_COMPONENTS = (KUBELET, KUBE_CONTROLLERS, KUBE_PROXY, CONTAINERD, CNI)


def cache_root() -> Path:
    explicit = os.environ.get("KAI_ISOLATOR_KUBE_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kai-isolator" / "kube"


def entry(component: Component) -> Path:
    return cache_root() / f"{component.name}-{component.version}-{component.digest()}"


def _go() -> str:
    # Go's own installer puts it in /usr/local/go, which a non-login shell's PATH may lack.
    go = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin")
    if go is None:
        raise BuildError("the local control plane is built from Go modules, and no `go` is on PATH: install Go >= 1.26")
    return go


def _go_env(component: Component) -> dict[str, str]:
    env = dict(os.environ)
    if not component.cgo:
        env["CGO_ENABLED"] = "0"
    # Two jobs and a nice level, so people sharing a small machine can still work while it builds;
    # the local toolchain only, and the committed go.sum as the only truth for what gets downloaded.
    env["GOFLAGS"] = " ".join(f for f in (env.get("GOFLAGS", ""), "-p=2", "-trimpath", "-buildvcs=false", "-mod=readonly") if f)
    env["GOTOOLCHAIN"] = "local"
    return env


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per cache entry at a time: a concurrent run waits and then finds the binaries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _count_packages(component: Component, env: dict[str, str]) -> int:
    done = subprocess.run([_go(), "list", "-deps", *component.tag_flags(), *component.packages], cwd=component.folder, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise BuildError(f"go list in {component.folder} failed:\n{done.stderr.strip()}")
    return len(done.stdout.split())


def _build(component: Component, target: Path, log: TextIO) -> None:
    env = _go_env(component)
    total = _count_packages(component, env)
    scratch = Path(tempfile.mkdtemp(prefix=f".{component.name}-", dir=target.parent))
    started = time.monotonic()
    compiled = 0
    lines: list[str] = []
    command = ["nice", "-n", "10", _go(), "build", "-v", "-ldflags", component.ldflags(), *component.tag_flags(), "-o", str(scratch) + "/", *component.packages]
    process = subprocess.Popen(command, cwd=component.folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()

    def report() -> None:  # a line while it builds: the first build takes many minutes
        while not stop.wait(PROGRESS_EVERY_S):
            print(f"  building {component.name} {component.version}: {compiled}/{total} packages compiled, "
                  f"{time.monotonic() - started:.0f}s", file=log, flush=True)

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            compiled += 1  # `go build -v` names each package as it compiles it (cached ones are not named)
            lines.append(line)
        rc = process.wait()
    finally:
        stop.set()
        reporter.join()
    if rc != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        tail = "".join(lines[-40:])
        raise BuildError(f"go build of {component.name} {component.version} in {component.folder} exited {rc}:\n{tail}")
    for program in component.programs():
        if not (scratch / program).is_file():
            shutil.rmtree(scratch, ignore_errors=True)
            raise BuildError(f"go build of {component.name} left no {program} in {scratch}")
    # mkdtemp made it 0700: an image that copies the cache (Dockerfile.devcluster) runs it as a non-root user.
    scratch.chmod(0o755)
    os.replace(scratch, target)  # atomic: a reader sees the whole entry or none
    print(f"built {component.name} {component.version} ({', '.join(component.programs())}) in "
          f"{time.monotonic() - started:.0f}s -> {target}", file=log, flush=True)


def ensure(component: Component, log: TextIO = sys.stderr) -> Path:
    """The cache entry holding `component`'s programs, built first if it is not there."""
    target = entry(component)
    if all((target / p).is_file() for p in component.programs()):
        return target
    with _locked(target.with_name(target.name + ".lock")):
        if all((target / p).is_file() for p in component.programs()):
            return target  # built by a concurrent run while this one waited
        if target.exists():
            shutil.rmtree(target)
        _go()  # no toolchain: say so before promising a build
        print(f"building {component.name} {component.version} from {component.folder} into {target.parent} "
              "(once per version; the first build takes a while)", file=log, flush=True)
        _build(component, target, log)
    return target


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kubectl: Path
    kube_version: str
    etcd_version: str


def ensure_all(log: TextIO = sys.stderr) -> Binaries:
    etcd = ensure(ETCD, log)
    kube = ensure(KUBE, log)
    return Binaries(etcd / "etcd", kube / "kube-apiserver", kube / "kubectl", KUBE.version, ETCD.version)


def promtool(log: TextIO = sys.stderr) -> Path:
    """The promtool that checks and unit-tests the alert rules in deploy/monitoring, built first if needed."""
    return ensure(PROMTOOL, log) / "promtool"


@dataclass(frozen=True)
class NodeBinaries:
    """The real node's programs besides runc, which comes from the system (Debian's `runc` package)."""

    kubelet: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    containerd: Path
    containerd_shim: Path
    ctr: Path
    cni_bin_dir: Path  # the folder the kubelet's CNI plugins are looked up in
    containerd_version: str
    kube_proxy: Path


def ensure_node(log: TextIO = sys.stderr) -> NodeBinaries:
    for node_side in (KUBELET, KUBE_PROXY):
        if node_side.version != KUBE.version:
            raise BuildError(f"{node_side.folder / 'go.mod'} pins k8s.io/kubernetes {node_side.version}, "
                             f"{KUBE.folder / 'go.mod'} {KUBE.version}: a node must run its control plane's release")
    kubelet = _timed(KUBELET, log)
    controllers = _timed(KUBE_CONTROLLERS, log)
    containerd = _timed(CONTAINERD, log)
    cni = _timed(CNI, log)
    proxy = _timed(KUBE_PROXY, log)
    return NodeBinaries(kubelet / "kubelet", controllers / "kube-controller-manager", controllers / "kube-scheduler",
                        containerd / "containerd", containerd / "containerd-shim-runc-v2", containerd / "ctr", cni, CONTAINERD.version,
                        proxy / "kube-proxy")


def _timed(component: Component, log: TextIO) -> Path:
    started = time.monotonic()
    target = ensure(component, log)
    print(f"  {component.name} {component.version}: {time.monotonic() - started:.1f}s", file=log, flush=True)
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--real-node"]):
        print("usage: python -m kai_isolator.services.devcluster.build [--real-node]", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        binaries = ensure_all()
        print(f"control plane ready in {time.monotonic() - started:.1f}s: etcd {binaries.etcd_version} {binaries.etcd}, "
              f"kube-apiserver {binaries.kube_version} {binaries.kube_apiserver}, kubectl {binaries.kubectl}", flush=True)
        started = time.monotonic()
        rule_checker = promtool()
        print(f"promtool ready in {time.monotonic() - started:.1f}s: {PROMTOOL.version} {rule_checker}", flush=True)
        if args:
            started = time.monotonic()
            node = ensure_node()
            print(f"real node ready in {time.monotonic() - started:.1f}s: kubelet {node.kubelet}, containerd {node.containerd_version} "
                  f"{node.containerd}, CNI plugins {node.cni_bin_dir}", flush=True)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
