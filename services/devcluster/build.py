"""Builds the local control plane (etcd, kube-apiserver, kubectl), promtool, for the real node its kubelet, runtime, CNI
plugin and OCI registry, and helm, from the pinned Go modules in `go/`, once; and the real KAI-Scheduler from its source
archive.

The binaries land in a cache outside the repo (`~/.cache/kai-isolator/kube/<component>-<version>-<digest>/`),
keyed by the module files, so a second run, or another checkout, reuses them. `python -m kai_isolator.services.devcluster.build`
builds what is missing and prints the paths (`--real-node` adds the node's programs, `--promtool` builds only promtool,
`--release-tools` only helm and the OCI registry, `--kai [PROGRAM...]` KAI's); `make test` runs it first.
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
import tarfile
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
        elif self.module == "github.com/distribution/distribution/v3":
            flags.append(f"-X {self.module}/version.version={self.version}")  # what its Makefile stamps
        elif self.module == "helm.sh/helm/v4":
            # What its Makefile stamps for a tagged build: the tag, and no "unreleased" metadata.
            flags += [f"-X {self.module}/internal/version.version={self.version}", f"-X {self.module}/internal/version.metadata=",
                      f"-X {self.module}/internal/version.gitTreeState=clean"]
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
# The OCI registry releases are pushed to and the real node pulls through: CNCF Distribution's own command (its cloud
# storage drivers come with it; only the filesystem one is used).
REGISTRY = Component("registry", MODULES / "registry", "github.com/distribution/distribution/v3",
                     ("github.com/distribution/distribution/v3/cmd/registry",), cgo=False)
# The helm that lints, renders, packages, pushes, installs and tests the chart: Helm 4's own command, static as its
# releases are.
HELM = Component("helm", MODULES / "helm", "helm.sh/helm/v4", ("helm.sh/helm/v4/cmd/helm",), cgo=False)
# The node agent's NRI plugin: shipped product (it goes into the node agent's image), so its module lives beside the
# agent (services/nodeagent/nri), built like the tools here; static, as it runs in whatever image carries it.
NRI_PLUGIN = Component("kai-isolator-nri", MODULES.parents[1] / "nodeagent" / "nri", "github.com/containerd/nri", (".",), cgo=False)
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


LOCK_WAIT_S = 3600.0
"""How long a builder waits for another's build of the same thing (a fresh machine's Kubernetes build takes minutes)."""


@contextlib.contextmanager
def locked(path: Path, timeout_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """One builder at a time: a concurrent run waits, at most `timeout_s`, and then finds the cache warm."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(path, "w") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"another build held {path} for over {timeout_s:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _count_packages(component: Component, env: dict[str, str], cwd: Path, packages: tuple[str, ...]) -> int:
    done = subprocess.run([_go(), "list", "-deps", *component.tag_flags(), *packages], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise BuildError(f"go list in {cwd} failed:\n{done.stderr.strip()}")
    return len(done.stdout.split())


def _build(component: Component, target: Path, log: TextIO) -> None:
    scratch = Path(tempfile.mkdtemp(prefix=f".{component.name}-", dir=target.parent))
    started = time.monotonic()
    try:
        _run_go_build(component, component.folder, component.packages, component.ldflags(), scratch, log, started)
        for program in component.programs():
            if not (scratch / program).is_file():
                raise BuildError(f"go build of {component.name} left no {program} in {scratch}")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    # mkdtemp made it 0700: an image that copies the cache (Dockerfile.devcluster) runs it as a non-root user.
    scratch.chmod(0o755)
    os.replace(scratch, target)  # atomic: a reader sees the whole entry or none
    print(f"built {component.name} {component.version} ({', '.join(component.programs())}) in "
          f"{time.monotonic() - started:.0f}s -> {target}", file=log, flush=True)


def _run_go_build(component: Component, cwd: Path, packages: tuple[str, ...], ldflags: str, out: Path, log: TextIO,
                  started: float) -> None:
    """`go build -o out/ packages` in `cwd`, niced, with a progress line every PROGRESS_EVERY_S seconds."""
    env = _go_env(component)
    total = _count_packages(component, env, cwd, packages)
    compiled = 0
    lines: list[str] = []
    command = ["nice", "-n", "10", _go(), "build", "-v", "-ldflags", ldflags, *component.tag_flags(), "-o", str(out) + "/", *packages]
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()

    def report() -> None:  # a line while it builds: the first build takes many minutes
        while not stop.wait(PROGRESS_EVERY_S):
            print(f"  building {component.name}: {compiled}/{total} packages compiled, "
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
        tail = "".join(lines[-40:])
        raise BuildError(f"go build of {component.name} in {cwd} exited {rc}:\n{tail}")


def ensure(component: Component, log: TextIO = sys.stderr) -> Path:
    """The cache entry holding `component`'s programs, built first if it is not there."""
    target = entry(component)
    if all((target / p).is_file() for p in component.programs()):
        return target
    with locked(target.with_name(target.name + ".lock")):
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


def helm(log: TextIO = sys.stderr) -> Path:
    """The helm every chart check, install and release runs, built first if needed."""
    return ensure(HELM, log) / "helm"


def registry(log: TextIO = sys.stderr) -> Path:
    """The OCI registry (`registry serve <config>`), built first if needed."""
    return ensure(REGISTRY, log) / "registry"


def nri_plugin(log: TextIO = sys.stderr) -> Path:
    """The node agent's NRI plugin (`kai-isolator-nri`), built first if needed."""
    return ensure(NRI_PLUGIN, log) / NRI_PLUGIN.name


def release_tools(log: TextIO = sys.stderr) -> tuple[Path, Path]:
    """helm and the OCI registry, built first if needed."""
    return helm(log), registry(log)


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
    registry: Path  # the OCI registry the node pulls its images from (through its mirrors)


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
    registry_entry = _timed(REGISTRY, log)
    _timed(NRI_PLUGIN, log)  # the node agent's NRI adapter, which the real node's tests start beside the agent
    return NodeBinaries(kubelet / "kubelet", controllers / "kube-controller-manager", controllers / "kube-scheduler",
                        containerd / "containerd", containerd / "containerd-shim-runc-v2", containerd / "ctr", cni, CONTAINERD.version,
                        proxy / "kube-proxy", registry_entry / "registry")


def _timed(component: Component, log: TextIO) -> Path:
    started = time.monotonic()
    target = ensure(component, log)
    print(f"  {component.name} {component.version}: {time.monotonic() - started:.1f}s", file=log, flush=True)
    return target


# KAI-Scheduler is published to us as a source archive (the Go module proxy does not serve it), kept outside the
# repository beside it (`../shared/third_party/kai-scheduler/`); KAI_ISOLATOR_KAI_SOURCE names another archive.
KAI_SOURCE_ENV = "KAI_ISOLATOR_KAI_SOURCE"
KAI_THIRD_PARTY = Path("shared") / "third_party" / "kai-scheduler"
KAI_MODULE = "github.com/kai-scheduler/KAI-scheduler"
# The programs a KAI install runs besides its operator, as `cmd/<name>` of the source tree.
KAI_PROGRAMS = ("scheduler", "binder", "admission", "resourcereservation", "podgrouper", "queuecontroller", "podgroupcontroller")


@dataclass(frozen=True)
class SourceArchive:
    """A Go source tree published as a tar.gz (KAI-Scheduler), and the `cmd/<program>` binaries built from it.

    Keyed by the archive's sha256 and the Go toolchain, not by a module version: the archive is the only truth.
    One cache entry holds every program built so far, each added when first asked for, so a test that runs only
    KAI's admission does not wait for the scheduler to compile.
    """

    name: str
    archive: Path
    module: str  # the module path go.mod declares, checked after unpacking
    version_package: str  # where the program's version variables live (`-X` at link time)
    programs_available: tuple[str, ...]

    @property
    def version(self) -> str:
        # `kai-scheduler-d5bc503.tar.gz`: the commit it was cut from, the only version the archive names.
        found = re.fullmatch(rf"{re.escape(self.name)}-([0-9a-zA-Z._-]+)\.tar\.gz", self.archive.name)
        if found is None:
            raise BuildError(f"{self.archive}: expected a file named {self.name}-<commit>.tar.gz")
        return found.group(1)

    def archive_sha256(self) -> str:
        if not self.archive.is_file():
            raise BuildError(f"no KAI-Scheduler source archive at {self.archive}: put it there or set {KAI_SOURCE_ENV}")
        sha = hashlib.sha256()
        with open(self.archive, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                sha.update(chunk)
        return sha.hexdigest()

    def ldflags(self) -> str:
        # What KAI's build/makefile/golang.mk stamps, from what the archive tells (no git history in it).
        return " ".join(["-s", "-w", f"-X {self.version_package}.gitCommit={self.version}",
                         f"-X {self.version_package}.gitVersion={self.version}", f"-X {self.version_package}.gitTreeState=clean"])

    def digest(self) -> str:
        sha = hashlib.sha256(f"{self.archive_sha256()}\0{_go_version()}\0{self.ldflags()}".encode())
        return sha.hexdigest()[:12]

    def packages(self, programs: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [p for p in programs if p not in self.programs_available]
        if unknown:
            raise BuildError(f"{self.name} has no program {', '.join(unknown)}; it has {', '.join(self.programs_available)}")
        return tuple(f"./cmd/{p}" for p in programs)


def kai_archive() -> Path:
    """The KAI-Scheduler source archive: KAI_ISOLATOR_KAI_SOURCE, else the one beside this checkout (or beside the
    main checkout when this is a git worktree)."""
    explicit = os.environ.get(KAI_SOURCE_ENV)
    if explicit:
        return Path(explicit)
    repo = Path(__file__).resolve().parents[2]
    roots = [repo.parent]
    common = _git_common_dir(repo)
    if common is not None and common.parent.parent != repo.parent:
        roots.append(common.parent.parent)
    for root in roots:
        found = sorted((root / KAI_THIRD_PARTY).glob("kai-scheduler-*.tar.gz"))
        if found:
            return found[-1]
    raise BuildError(f"no kai-scheduler-<commit>.tar.gz in {' or '.join(str(r / KAI_THIRD_PARTY) for r in roots)}; "
                     f"set {KAI_SOURCE_ENV} to the archive")


def _git_common_dir(repo: Path) -> Path | None:
    """A worktree's main repository's `.git`, where `.git` is a file pointing into it."""
    dot_git = repo / ".git"
    if not dot_git.is_file():
        return None
    found = re.match(r"gitdir: (.+)", dot_git.read_text().strip())
    if found is None:
        return None
    gitdir = Path(found.group(1))  # <main>/.git/worktrees/<name>
    return gitdir.parent.parent if gitdir.parent.name == "worktrees" else None


def kai_source() -> SourceArchive:
    return SourceArchive("kai-scheduler", kai_archive(), KAI_MODULE, f"{KAI_MODULE}/pkg/scheduler/version", KAI_PROGRAMS)


def _go_version() -> str:
    done = subprocess.run([_go(), "env", "GOVERSION"], capture_output=True, text=True, timeout=60, env=_local_toolchain_env())
    if done.returncode != 0 or not done.stdout.strip():
        raise BuildError(f"`go env GOVERSION` failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _local_toolchain_env() -> dict[str, str]:
    return {**os.environ, "GOTOOLCHAIN": "local"}


def kai_entry(source: SourceArchive) -> Path:
    return cache_root() / f"{source.name}-{source.version}-{source.digest()}"


def _unpack(source: SourceArchive, into: Path) -> Path:
    """The archive's one top folder, unpacked under `into`, with its go.mod checked to be the module expected."""
    with tarfile.open(source.archive) as tar:
        tar.extractall(into, filter="data")  # refuses links and paths that leave `into`
    tops = [p for p in into.iterdir() if p.is_dir()]
    if len(tops) != 1 or not (tops[0] / "go.mod").is_file():
        raise BuildError(f"{source.archive}: expected one top folder with a go.mod, found {[p.name for p in into.iterdir()]}")
    declared = re.search(r"^module (\S+)$", (tops[0] / "go.mod").read_text(), re.M)
    if declared is None or declared.group(1) != source.module:
        raise BuildError(f"{source.archive}: go.mod declares {declared.group(1) if declared else 'no module'}, not {source.module}")
    return tops[0]


def ensure_kai(programs: tuple[str, ...] = KAI_PROGRAMS, log: TextIO = sys.stderr) -> Path:
    """The cache entry holding KAI-Scheduler's `programs`, the missing ones built first from the source archive."""
    source = kai_source()
    target = kai_entry(source)
    packages = source.packages(programs)
    if all((target / p).is_file() for p in programs):
        return target
    with locked(target.with_name(target.name + ".lock")):
        missing = tuple(p for p in programs if not (target / p).is_file())
        if not missing:
            return target
        target.mkdir(parents=True, exist_ok=True)
        target.chmod(0o755)
        print(f"building {source.name} {source.version} ({', '.join(missing)}) from {source.archive} into {target} "
              "(once per archive; the first build takes minutes)", file=log, flush=True)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f".{source.name}-src-", dir=target.parent) as scratch:
            tree = _unpack(source, Path(scratch) / "src")
            out = Path(scratch) / "bin"
            out.mkdir()
            # The archive's go.sum is the only truth for what gets downloaded, as for the pinned modules.
            build = Component(source.name, tree, source.module, packages)
            _run_go_build(build, tree, packages, source.ldflags(), out, log, started)
            for program in missing:
                built = out / program
                if not built.is_file():
                    raise BuildError(f"go build of {source.name} left no {program} in {out}")
                os.replace(built, target / program)  # atomic per program: a reader sees it whole or not at all
        print(f"built {source.name} {source.version} ({', '.join(missing)}) in {time.monotonic() - started:.0f}s -> {target}",
              file=log, flush=True)
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--kai"]:
        return _main_kai(tuple(args[1:]) or KAI_PROGRAMS)
    if args not in ([], ["--real-node"], ["--promtool"], ["--release-tools"]):
        print("usage: python -m kai_isolator.services.devcluster.build [--real-node | --promtool | --release-tools | --kai [PROGRAM...]]",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        if args == ["--promtool"]:  # only the alert-rule tests run it, so `make run` never waits for it
            rule_checker = promtool()
            print(f"promtool ready in {time.monotonic() - started:.1f}s: {PROMTOOL.version} {rule_checker}", flush=True)
            return 0
        if args == ["--release-tools"]:  # the chart's checks and the release need no control plane
            helm_path, registry_path = release_tools()
            print(f"release tools ready in {time.monotonic() - started:.1f}s: helm {HELM.version} {helm_path}, "
                  f"registry {REGISTRY.version} {registry_path}", flush=True)
            return 0
        binaries = ensure_all()
        print(f"control plane ready in {time.monotonic() - started:.1f}s: etcd {binaries.etcd_version} {binaries.etcd}, "
              f"kube-apiserver {binaries.kube_version} {binaries.kube_apiserver}, kubectl {binaries.kubectl}", flush=True)
        if args == ["--real-node"]:
            started = time.monotonic()
            node = ensure_node()
            print(f"real node ready in {time.monotonic() - started:.1f}s: kubelet {node.kubelet}, containerd {node.containerd_version} "
                  f"{node.containerd}, CNI plugins {node.cni_bin_dir}", flush=True)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _main_kai(programs: tuple[str, ...]) -> int:
    """KAI-Scheduler's programs only: no control plane needed to build them."""
    started = time.monotonic()
    try:
        target = ensure_kai(programs)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"kai-scheduler ready in {time.monotonic() - started:.1f}s: {', '.join(programs)} in {target}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
