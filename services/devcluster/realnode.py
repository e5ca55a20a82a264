"""A real Kubernetes node on this machine: kubelet + containerd + runc in their own mount and network namespaces.

Run the way kind runs a node, without the container: a namespace holder (`unshare --mount --net`), a veth pair to
the host namespace on private addresses (no route out, so nothing leaves the machine), every path the kubelet,
containerd and CNI write bind-mounted from the work dir, and the pods' cgroups under a cgroup of the node's own
in every hierarchy, removed by `stop()`. A DEV AND TEST FIXTURE.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .build import NodeBinaries
from .oci import image_archive

PAUSE_SOURCE = Path(__file__).resolve().parent / "node" / "pause.c"
PAUSE_IMAGE = "kai-isolator.local/pause:1"
RUNC = "/usr/sbin/runc"  # Debian's `runc` package
# Private addresses for the veth pairs: a /30 each, picked at random among those no interface holds.
VETH_POOL = ipaddress.ip_network("10.213.0.0/16")
# The kernel settings the kubelet insists on (it rewrites them otherwise): shown to it at these values, so it never
# writes this machine's own.
KUBELET_SYSCTLS = {"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10", "kernel/panic_on_oops": "1",
                   "kernel/keys/root_maxkeys": "1000000", "kernel/keys/root_maxbytes": "25000000"}
# The node's own /run, /var/lib and /var/log: folders of the work dir bound over the machine's, inside its mount namespace.
NODE_MOUNTS = ("/run", "/var/lib", "/var/log")
# The node's /usr/local: the machine's, read-only, under what the node writes (an overlay whose upper folder is in the
# work dir), so the node agent's /usr/local/vgpu and whatever the machine keeps in /usr/local (an interpreter) are both there.
NODE_OVERLAYS = ("/usr/local",)
# Each node's pods get a /24 of their own, routed from the host namespace through the node's veth (as a cluster's pod
# network is routed between its machines): the API server reaches a webhook's pod at its endpoint address.
POD_POOL = ipaddress.ip_network("10.214.0.0/16")
READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0


class NodeError(RuntimeError):
    """The real node could not start (no runc, no root, a daemon that exited) or be cleaned up; carries the log tail."""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run(*argv: str, timeout_s: float = 30) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise NodeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


@dataclass(frozen=True)
class NodeAddresses:
    """The veth pair: the host's end (where the API server listens) and the node's (its InternalIP)."""

    host_ip: str
    node_ip: str
    host_link: str
    node_link: str
    prefix: int = 30
    pod_subnet: str = "10.214.0.0/24"

    @staticmethod
    def pick() -> NodeAddresses:
        taken = _run("ip", "-o", "-4", "addr", "show")
        routes = _run("ip", "-o", "-4", "route", "show")
        suffix = f"{os.getpid() & 0xFFFF:04x}{random.randrange(256):02x}"
        for _ in range(100):
            subnet = random.choice(list(VETH_POOL.subnets(new_prefix=30)))
            pods = str(random.choice(list(POD_POOL.subnets(new_prefix=24))))
            host, node = (str(a) for a in list(subnet.hosts())[:2])
            if f" {host}/" not in taken and f" {node}/" not in taken and not any(r.startswith(f"{pods} ") for r in routes.splitlines()):
                return NodeAddresses(host, node, f"kain{suffix}h", f"kain{suffix}n", pod_subnet=pods)
        raise NodeError(f"no free /30 in {VETH_POOL} and /24 in {POD_POOL}")


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, named ones, a v2 unified one), from /proc/self/mountinfo."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype in ("cgroup", "cgroup2"):
            found.append(Path(fields[4]))
    return found


class NodeCgroup:
    """`/<name>` in every hierarchy: the kubelet's cgroupRoot, with the node's daemons in `/<name>/runtime`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.roots = [h / name for h in cgroup_hierarchies()]

    def create(self) -> None:
        for root in self.roots:
            for folder in (root, root / "runtime"):
                folder.mkdir(exist_ok=True)
                # A v1 cpuset cgroup starts with no CPUs and no memory nodes: nothing could join it.
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    if (folder / knob).exists():
                        (folder / knob).write_text((folder.parent / knob).read_text())

    def join_command(self) -> str:
        """Shell that moves itself (`$$`) into the runtime cgroup of every hierarchy, so all it starts is counted there."""
        return " && ".join(f"echo $$ > {shlex.quote(str(root / 'runtime' / 'cgroup.procs'))}" for root in self.roots)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for root in self.roots:
            for procs in root.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    found.update(int(p) for p in procs.read_text().split())
        return found

    def remove(self, timeout_s: float = 20) -> None:
        """Kill whatever is left in it (shims, containers) and remove it, deepest folders first."""
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise NodeError(f"processes {sorted(pids)} still in cgroup {self.name} after {timeout_s:.0f}s")
            time.sleep(0.05)
        for root in self.roots:
            if not root.exists():
                continue
            for folder in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [root]:
                while True:
                    try:
                        folder.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise NodeError(f"cgroup {folder} could not be removed") from None
                        time.sleep(0.05)


def compiled(source: Path, cache: Path, *flags: str) -> Path:
    """`source` (C) built once per source and flags into the cache: the node's own small programs."""
    digest = hashlib.sha256(source.read_bytes() + "\0".join(flags).encode()).hexdigest()[:12]
    program = cache / f"{source.stem}-{digest}"
    if not program.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = program.with_name(f".{program.name}-{os.getpid()}")
        _run("gcc", "-O2", "-Wall", "-o", str(partial), str(source), *flags, timeout_s=120)
        partial.replace(program)
    return program


def pause_image(cache: Path) -> Path:
    """The sandbox image: the static pause program alone."""
    pause = compiled(PAUSE_SOURCE, cache, "-static", "-s")
    archive = cache / f"{pause.name}.tar"
    if not archive.is_file():
        image_archive(PAUSE_IMAGE, {"/pause": pause}, archive.with_name(f".{archive.name}-{os.getpid()}"), entrypoint=["/pause"]).replace(archive)
    return archive


class RealNode:
    """One node: `start()` makes its namespaces, mounts and cgroups, then runs containerd and the kubelet in them."""

    def __init__(self, binaries: NodeBinaries, workdir: Path, *, name: str, kubeconfig: Path | None, ca_file: Path,
                 addresses: NodeAddresses, cache: Path, labels: dict[str, str] | None = None, runtimes: dict[str, Path] | None = None,
                 default_runtime: str = "runc", registry_hosts: Path | None = None) -> None:
        self.binaries = binaries
        self.workdir = Path(workdir)
        self.name = name
        self.kubeconfig = kubeconfig
        self.ca_file = ca_file
        self.addresses = addresses
        self.cache = cache
        self.labels = labels or {}
        self.runtimes = runtimes or {}  # extra containerd runtime handlers: name -> the runc-compatible program
        self.default_runtime = default_runtime
        # containerd's registry host configuration (one `<registry>/hosts.toml` each): the mirrors its pulls go through.
        self.registry_hosts = registry_hosts
        self.cluster_dns: str | None = None  # the pods' nameserver (the kubelet's clusterDNS), set before start_daemons
        self.fs = self.workdir / "fs"  # the node's /run, /var/lib, /var/log and what it adds to /usr/local
        self.cgroup = NodeCgroup(f"kai-isolator-node-{addresses.node_link}")
        self._holder: subprocess.Popen[bytes] | None = None
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.startup_s: dict[str, float] = {}

    # --- paths as the host sees them ---------------------------------------------------------

    @property
    def root(self) -> Path:
        """The node's / as this machine sees it (as a node agent's host-root mount is): through its namespace holder."""
        assert self._holder is not None, "make the node's namespaces first"
        return Path(f"/proc/{self._holder.pid}/root")

    def host_path(self, inside: str) -> Path:
        """Where a path of the node lies on this machine."""
        return self.root / inside.lstrip("/")

    @property
    def containerd_socket(self) -> Path:
        return self.host_path("/run/containerd/containerd.sock")

    @property
    def device_plugin_dir(self) -> Path:
        return self.host_path("/var/lib/kubelet/device-plugins")

    # --- lifecycle --------------------------------------------------------------------------

    def make_namespaces(self) -> None:
        """The node's namespaces, veth pair, mounts and cgroup: its addresses exist from here on."""
        if os.geteuid() != 0:
            raise NodeError("the real node needs root (namespaces, mounts, cgroups)")
        if not Path(RUNC).is_file():
            raise NodeError(f"no {RUNC}: install Debian's runc package (apt-get install runc)")
        started = time.monotonic()
        self.cgroup.create()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for mount in NODE_MOUNTS:
            (self.fs / mount.lstrip("/")).mkdir(parents=True, exist_ok=True)
        self._holder = subprocess.Popen(["unshare", "--mount", "--net", "--propagation", "private", "sleep", "infinity"],
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self._holder.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            if self._holder.poll() is not None or time.monotonic() > deadline:
                raise NodeError("unshare --mount --net did not make the node's namespaces (needs CAP_SYS_ADMIN)")
            time.sleep(0.01)
        a = self.addresses
        _run("ip", "link", "add", a.host_link, "type", "veth", "peer", "name", a.node_link, "netns", str(self._holder.pid))
        _run("ip", "addr", "add", f"{a.host_ip}/{a.prefix}", "dev", a.host_link)
        _run("ip", "link", "set", a.host_link, "up")
        # Goes with the link in stop(): the route to the node's pods.
        _run("ip", "route", "add", a.pod_subnet, "via", a.node_ip, "dev", a.host_link)
        sysctls = self.workdir / "sysctl"
        for key, value in KUBELET_SYSCTLS.items():
            (sysctls / key).parent.mkdir(parents=True, exist_ok=True)
            (sysctls / key).write_text(value + "\n")
        # No default route: the node reaches the host's end of the veth and nothing else.
        script = [f"ip addr add {a.node_ip}/{a.prefix} dev {a.node_link}", f"ip link set {a.node_link} up", "ip link set lo up"]
        script += [f"mount --bind {shlex.quote(str(self.fs / m.lstrip('/')))} {m}" for m in NODE_MOUNTS]
        for mount in NODE_OVERLAYS:
            upper, work = (self.fs / f"{mount.strip('/').replace('/', '-')}-{kind}" for kind in ("upper", "work"))
            upper.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            script.append(f"mount -t overlay overlay -o {shlex.quote(f'lowerdir={mount},upperdir={upper},workdir={work}')} {mount}")
        script += [f"mount --bind -o ro {shlex.quote(str(sysctls / k))} /proc/sys/{k}" for k in KUBELET_SYSCTLS]
        self._in_node(" && ".join(script))
        self.startup_s["namespaces"] = time.monotonic() - started

    def start_daemons(self) -> None:
        """containerd (with the sandbox image) and the kubelet, which registers the node."""
        self._start_containerd()
        self._import(pause_image(self.cache))
        self._start_kubelet()

    def _nsenter(self) -> list[str]:
        assert self._holder is not None
        return ["nsenter", f"--target={self._holder.pid}", "--mount", "--net", "--"]

    def _in_node(self, script: str, timeout_s: float = 30) -> str:
        return _run(*self._nsenter(), "sh", "-c", script, timeout_s=timeout_s)

    def exec(self, *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """A command in the node's namespaces (as `docker exec` into a kind node)."""
        return subprocess.run([*self._nsenter(), *argv], capture_output=True, text=True, timeout=timeout_s)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            # Join the node's cgroup first, then enter its namespaces: what the daemon starts (shims) is the node's too.
            process = subprocess.Popen(["sh", "-c", f'{self.cgroup.join_command()} && exec "$@"', name, *self._nsenter(), *argv],
                                       stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                       env={**os.environ, **(env or {})})
        finally:
            log.close()
        self._daemons[name] = process
        return process

    def stop_daemon(self, name: str) -> None:
        """One node daemon ended (SIGTERM, then SIGKILL), as stopping its DaemonSet pod would; a no-op for one not running."""
        self.terminate(self._daemons.pop(name, None))

    def wait_for_path(self, name: str, path: Path, timeout_s: float = 15) -> None:
        """Until daemon `name` has made `path` (its socket), or it exits, or `timeout_s` passes."""
        self._wait(name, path.exists, timeout_s)

    def _wait(self, name: str, ready: object, timeout_s: float) -> None:
        process = self._daemons[name]
        deadline = time.monotonic() + timeout_s
        while not ready():  # type: ignore[operator]
            if process.poll() is not None:
                raise NodeError(f"{name} exited {process.returncode} while starting:\n{_tail(self.workdir / f'{name}.log')}")
            if time.monotonic() > deadline:
                raise NodeError(f"{name} not ready after {timeout_s:.0f}s:\n{_tail(self.workdir / f'{name}.log')}")
            time.sleep(0.1)

    # --- containerd ---------------------------------------------------------------------

    def containerd_config(self) -> str:
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        handlers = {"runc": Path(RUNC), **self.runtimes}
        lines = [
            "version = 3",
            # Its defaults, which are the node's own: its /var/lib and /run are the work dir's.
            "root = '/var/lib/containerd'", "state = '/run/containerd'",
            # The tracing processors would open sockets and files of their own; the node needs neither. NRI stays on,
            # as containerd 2.x ships it and a GPU Operator node runs it: the node agent's plugin joins container creation.
            "disabled_plugins = ['io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing']",
            "[grpc]", "  address = '/run/containerd/containerd.sock'",
            "[ttrpc]", "  address = '/run/containerd/containerd.sock.ttrpc'",
            "[plugins.'io.containerd.internal.v1.opt']", "  path = '/var/lib/containerd-opt'",
            *self.nri_config(),
            "[plugins.'io.containerd.image-verifier.v1.bindir']",
            "  bin_dir = '/var/lib/containerd-opt/image-verifier/bin'",
            "[plugins.'io.containerd.cri.v1.images']", "  snapshotter = 'overlayfs'",
            "[plugins.'io.containerd.cri.v1.images'.pinned_images]", f"  sandbox = {json.dumps(PAUSE_IMAGE)}",
            *(["[plugins.'io.containerd.cri.v1.images'.registry]", f"  config_path = {json.dumps(str(self.registry_hosts))}"]
              if self.registry_hosts is not None else []),
            f"[{runtime}]",
            # Root here lacks CAP_SYS_RESOURCE: runc could not lower a container's oom_score_adj (kubelet asks -997
            # for the pause container) and every sandbox would fail.
            "  restrict_oom_score_adj = true",
            "  netns_mounts_under_state_dir = true",
            "  cdi_spec_dirs = []",
            f"[{runtime}.cni]", f"  bin_dirs = [{json.dumps(str(self.binaries.cni_bin_dir))}]",
            f"  conf_dir = {json.dumps(str(self.workdir / 'cni'))}",
            f"[{runtime}.containerd]", f"  default_runtime_name = {json.dumps(self.default_runtime)}",
        ]
        for handler, binary in handlers.items():
            lines += [f"[{runtime}.containerd.runtimes.{handler}]", "  runtime_type = 'io.containerd.runc.v2'",
                      f"[{runtime}.containerd.runtimes.{handler}.options]", f"  BinaryName = {json.dumps(str(binary))}",
                      "  SystemdCgroup = false"]
        return "\n".join(lines) + "\n"

    NRI_SOCKET = "/var/run/nri/nri.sock"  # containerd's default, in the node's own /run

    def nri_config(self) -> list[str]:
        """NRI as containerd 2.x runs it by default, with its paths in the node's own /var/lib, a 2 s request timeout
        (the default, which the agent's hold stays under), and the default validator on, so a pod annotated
        `required-plugins.noderesource.dev/pod` fails creation while the plugin it names is not registered."""
        nri = "plugins.'io.containerd.nri.v1.nri'"
        return [f"[{nri}]", "  disable = false", f"  socket_path = {json.dumps(self.NRI_SOCKET)}",
                "  plugin_path = '/var/lib/nri/plugins'", "  plugin_config_path = '/var/lib/nri/conf.d'",
                "  plugin_request_timeout = '2s'", f"[{nri}.default_validator]", "  enable = true"]

    NRI_PLUGIN_DAEMON = "nri-plugin"

    def start_nri_plugin(self, program: Path, agent_socket: Path, name: str = "kai-isolator", index: str = "10") -> None:
        """The node agent's NRI plugin as a node runs it beside containerd (a process in the node's namespaces, as the
        agent's DaemonSet pod would be), asking the agent at `agent_socket`; returns once the plugin says containerd
        synchronized it (NRI's stub logs `Started plugin` after registration and the runtime's sync), so the next
        container created goes through it."""
        log = self.workdir / f"{self.NRI_PLUGIN_DAEMON}.log"
        seen = log.stat().st_size if log.exists() else 0  # the log is appended to: a restart's line is after this
        started = f"Started plugin {index}-{name}".encode()

        def in_log() -> bool:
            with log.open("rb") as text:
                text.seek(seen)
                return started in text.read()

        self.spawn(self.NRI_PLUGIN_DAEMON, [str(program), f"--name={name}", f"--idx={index}", f"--nri-socket={self.NRI_SOCKET}",
                                            f"--agent-socket={agent_socket}"])
        self._wait(self.NRI_PLUGIN_DAEMON, in_log, 30)

    def stop_nri_plugin(self) -> None:
        """The plugin gone (containerd drops it when its connection closes): creation goes on without it."""
        self.stop_daemon(self.NRI_PLUGIN_DAEMON)

    def _start_containerd(self) -> None:
        started = time.monotonic()
        cni = self.workdir / "cni"
        cni.mkdir(parents=True, exist_ok=True)
        # containerd's CRI wants an eth0 with an address in every sandbox that is not on the host network (loopback alone
        # fails with "failed to find network info for sandbox"): a veth to the node (ptp) on the node's pod subnet, which
        # the host routes to the node. No masquerade and no route out of this machine: pods reach the node, each other
        # and the host's end of the veth (the API server).
        (cni / "10-pods.conflist").write_text(json.dumps({"cniVersion": "1.0.0", "name": "pods", "plugins": [
            {"type": "ptp", "ipMasq": False, "ipam": {"type": "host-local", "ranges": [[{"subnet": self.addresses.pod_subnet}]],
                                                      "routes": [{"dst": "0.0.0.0/0"}]}}]}))
        config = self.workdir / "containerd.toml"
        config.write_text(self.containerd_config())
        path = f"{self.binaries.containerd.parent}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        self.spawn("containerd", [str(self.binaries.containerd), f"--config={config}"], env={"PATH": path})
        self._wait("containerd", lambda: self.containerd_socket.is_socket() and self.ctr("version").returncode == 0, 60)
        self.startup_s["containerd"] = time.monotonic() - started

    def ctr(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """containerd's own client, in the node (what it keeps client-side, such as fifos, stays the node's)."""
        return subprocess.run([*self._nsenter(), str(self.binaries.ctr), "--address=/run/containerd/containerd.sock", "--namespace=k8s.io", *args],
                              capture_output=True, text=True, timeout=timeout_s)

    def _import(self, archive: Path) -> None:
        started = time.monotonic()
        self.import_image(archive)
        self.startup_s["pause image"] = time.monotonic() - started

    def pull_image(self, reference: str) -> None:
        """An image pulled into containerd's k8s.io namespace through the node's registry mirrors (its hosts.toml files),
        as the kubelet's pulls go; what `crictl pull` does on a node, for pods that never pull themselves."""
        if self.registry_hosts is None:
            raise NodeError(f"no registry mirrors configured on node {self.name}: cannot pull {reference}")
        done = self.ctr("images", "pull", f"--hosts-dir={self.registry_hosts}", "--platform=linux/amd64", reference)
        if done.returncode != 0:
            raise NodeError(f"ctr images pull {reference} exited {done.returncode}: {done.stderr.strip()}")

    def import_image(self, archive: Path) -> None:
        """An image archive (OCI layout or `docker save`) into containerd's k8s.io namespace, unpacked for the CRI."""
        done = self.ctr("images", "import", "--platform=linux/amd64", str(archive))
        if done.returncode != 0:
            raise NodeError(f"ctr images import {archive} exited {done.returncode}: {done.stderr.strip()}")

    # --- kubelet -------------------------------------------------------------------------

    def kubelet_config(self) -> dict[str, object]:
        dns = {"clusterDNS": [self.cluster_dns], "clusterDomain": "cluster.local"} if self.cluster_dns else {}
        return {**dns,
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # This machine kind is cgroup v1, which the kubelet refuses by default since 1.35.
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.cgroup.name}",
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.ca_file)}},
            "authorization": {"mode": "Webhook"},
            "address": self.addresses.node_ip, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
            # No cluster DNS: pods get a resolver on their own loopback, which answers nothing and sends nothing out.
            "resolvConf": str(self._resolv_conf()),
            # The machine's disk is shared with other work: evict for a nearly full disk only.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "failSwapOn": False, "serializeImagePulls": False,
        }

    def _resolv_conf(self) -> Path:
        path = self.workdir / "resolv.conf"
        path.write_text("nameserver 127.0.0.1\n")
        return path

    def _start_kubelet(self) -> None:
        started = time.monotonic()
        config = self.workdir / "kubelet.json"
        config.write_text(json.dumps(self.kubelet_config(), indent=2))
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        args = [str(self.binaries.kubelet), f"--config={config}", f"--hostname-override={self.name}", f"--node-ip={self.addresses.node_ip}"]
        if self.kubeconfig is not None:  # none: a standalone kubelet (static pods only)
            args.append(f"--kubeconfig={self.kubeconfig}")
        if labels:
            args.append(f"--node-labels={labels}")
        self.spawn("kubelet", args)
        self._wait("kubelet", lambda: self.host_path("/var/lib/kubelet/device-plugins/kubelet.sock").is_socket(), READY_TIMEOUT_S)
        self.startup_s["kubelet"] = time.monotonic() - started

    @staticmethod
    def terminate(process: subprocess.Popen[bytes] | None) -> None:
        """SIGTERM to the process's group, SIGKILL after STOP_GRACE_S."""
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def stop(self) -> None:
        """Everything the node started ends; its cgroups, veth and mounts (with its namespaces) go."""
        errors = []
        for name in ("kubelet", *(n for n in self._daemons if n not in ("kubelet", "containerd")), "containerd"):
            self.terminate(self._daemons.pop(name, None))
        try:
            self.cgroup.remove()
        except NodeError as error:
            errors.append(str(error))
        if self._holder is not None and self._holder.poll() is None:
            os.killpg(self._holder.pid, signal.SIGKILL)
            self._holder.wait(timeout=10)
        subprocess.run(["ip", "link", "del", self.addresses.host_link], capture_output=True, timeout=30)
        if errors:
            raise NodeError("; ".join(errors))
