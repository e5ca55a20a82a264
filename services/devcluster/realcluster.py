"""`RealNodeCluster`: the local control plane plus kube-controller-manager, kube-scheduler and one real GPU node.

The node runs real pods in runc (see realnode.py); its GPU is faked at the driver level only, as a GPU Operator
cluster looks to Kubernetes (see fakegpu.py). Its images come from a real OCI registry on the host's end of its veth
(oci_registry.py), which its containerd reaches through registry mirrors for docker.io, ghcr.io and nvcr.io.
KAI-Scheduler stays simulated through the API. A DEV AND TEST FIXTURE.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from kai_isolator.shared.errors import ConfigError

from .build import BuildError, NodeBinaries, cache_root, ensure_node
from .cluster import DevCluster
from .fakegpu import FakeGpu
from .oci_registry import OciRegistry
from .plane import ControlPlaneError
from .realnode import PAUSE_IMAGE, NodeAddresses, NodeError, RealNode

NODE_NAME = "gpu-node-1"
GPU_MEMORY_MIB = 15360
READY_TIMEOUT_S = 120.0
PROXY_READY_TIMEOUT_S = 60.0
CLUSTER_DNS_PORT = 53


class RealNodeCluster:
    """Start with `async with RealNodeCluster(...)`; `cluster` is the DevCluster (REST, kubectl), `node` the real node."""

    def __init__(self, *, workdir: Path | None = None, build_log: TextIO = sys.stderr, driver_branch: int = 580) -> None:
        self._own_workdir = workdir is None
        # The fake driver's branch: 580 (no per-cgroup memory limits, the library and the enforcer hold) or 615 (NVML
        # 13.4's limits: a node whose agent takes part in creation is driver-capped).
        self.driver_branch = driver_branch
        self.workdir = Path(tempfile.mkdtemp(prefix="kai-isolator-realnode-")) if workdir is None else Path(workdir)
        self._build_log = build_log
        self.cluster: DevCluster | None = None
        self.node: RealNode | None = None
        self.gpu: FakeGpu | None = None
        self.registry: OciRegistry | None = None
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.startup_s: dict[str, float] = {}

    async def start(self) -> RealNodeCluster:
        started = time.monotonic()
        try:
            binaries = await self._timed("build cache (node)", asyncio.to_thread(ensure_node, self._build_log))
        except BuildError as error:
            raise ConfigError(f"the real node could not be built: {error}") from None
        try:
            await self._start(binaries)
        except BaseException:
            await self.stop()
            raise
        self.startup_s["total"] = time.monotonic() - started
        return self

    async def _timed(self, phase: str, work: Any) -> Any:
        started = time.monotonic()
        result = await work
        self.startup_s[phase] = time.monotonic() - started
        return result

    async def _start(self, binaries: NodeBinaries) -> None:
        addresses = NodeAddresses.pick()
        self.gpu = FakeGpu(self.workdir / "gpu", GPU_MEMORY_MIB, driver_branch=self.driver_branch)
        self.gpu.prepare(cache_root())
        # The registry listens where the API server does, on the host's end of the node's veth: the one address both the
        # node's containerd and this machine's clients (helm, the pushes) reach.
        self.registry = OciRegistry(binaries.registry, self.workdir / "registry", address=addresses.host_ip)
        self.node = RealNode(binaries, self.workdir / "node", name=NODE_NAME, kubeconfig=self.workdir / "kubelet.kubeconfig",
                             ca_file=self.workdir / "cluster" / "plane" / "ca.crt", addresses=addresses, cache=cache_root(),
                             labels=self.gpu.labels(), runtimes={"nvidia": self.gpu.runtime}, default_runtime="nvidia",
                             registry_hosts=self.workdir / "node" / "registry-hosts")
        await self._timed("node namespaces", asyncio.to_thread(self.node.make_namespaces))
        await self._timed("registry", asyncio.to_thread(self.registry.start))
        self.registry.write_mirrors(self.workdir / "node" / "registry-hosts")
        self.node.cluster_dns = addresses.node_ip
        # The API server listens on the host's end of the node's veth, the one address both sides reach.
        self.cluster = DevCluster(workdir=self.workdir / "cluster", nodes={}, listen=f"{addresses.host_ip}:0",
                                  server_name=addresses.host_ip, build_log=self._build_log)
        await self.cluster.start()
        self.startup_s.update({phase: s for phase, s in self.cluster.startup_s.items() if phase != "total"})
        plane = self.cluster.plane
        assert plane is not None
        cert, key = plane.node_credentials(NODE_NAME)
        plane.write_kubeconfig(self.workdir / "kubelet.kubeconfig", NODE_NAME, {"client-certificate": str(cert), "client-key": str(key)})
        await self._timed("controller-manager and scheduler", asyncio.to_thread(self._start_controllers, binaries))
        await self._timed("node daemons", asyncio.to_thread(self.node.start_daemons))
        self.node.spawn("fake-gpu", self.gpu.ledger_command())  # the GPU's books, before any container can reach it
        await self._timed("fake GPU ledger", asyncio.to_thread(self.node.wait_for_path, "fake-gpu", self.gpu.ledger_socket))
        self.node.spawn("device-plugin", self.gpu.device_plugin_command())
        await self._timed("node ready", self._until_ready())
        await self._timed("service network", asyncio.to_thread(self._start_service_network, binaries))
        runtime_class = self.gpu.runtime_class()
        await self.cluster.ensure_runtime_class(runtime_class["metadata"]["name"], runtime_class["handler"])
        assert self.cluster.scheduler is not None
        self.cluster.scheduler.only_kai_pods = True
        self.cluster.scheduler.nodes[NODE_NAME] = GPU_MEMORY_MIB
        # The simulated reservation pods run for real here: the node's sandbox program keeps them up.
        self.cluster.scheduler.options = dataclasses.replace(self.cluster.scheduler.options, reservation_image=PAUSE_IMAGE)

    def switch_driver(self, branch: int) -> None:
        """The node's driver replaced by another branch's, as a driver upgrade (or downgrade) does: the ledger restarts
        answering as `branch`. Only while no container holds device memory (the books start empty), and the node
        agent's mode is decided when it starts, so start it after this."""
        assert self.node is not None and self.gpu is not None
        if branch == self.gpu.driver_branch:
            return
        self.node.stop_daemon("fake-gpu")
        self.gpu.ledger_socket.unlink(missing_ok=True)
        self.gpu.driver_branch = self.driver_branch = branch
        self.node.spawn("fake-gpu", self.gpu.ledger_command())
        self.node.wait_for_path("fake-gpu", self.gpu.ledger_socket)

    def _start_controllers(self, binaries: NodeBinaries) -> None:
        assert self.cluster is not None and self.cluster.plane is not None
        plane = self.cluster.plane
        admin = str(plane.admin_kubeconfig)
        self._spawn("kube-controller-manager", [
            str(binaries.kube_controller_manager), f"--kubeconfig={admin}", "--leader-elect=false", "--secure-port=0",
            f"--service-account-private-key-file={plane.workdir / 'sa.key'}", f"--root-ca-file={plane.workdir / 'ca.crt'}",
            "--use-service-account-credentials=false"])
        self._spawn("kube-scheduler", [str(binaries.kube_scheduler), f"--kubeconfig={admin}", "--leader-elect=false", "--secure-port=0"])

    def _start_service_network(self, binaries: NodeBinaries) -> None:
        """What every cluster gives its pods besides the CNI: the `kubernetes` Service's endpoint (the API server, on the
        host's end of the veth), kube-proxy for ClusterIPs, and cluster DNS for Service names (on the node's address)."""
        assert self.cluster is not None and self.cluster.plane is not None and self.node is not None
        plane, node = self.cluster.plane, self.node
        # The API server runs with --endpoint-reconciler-type=none (it advertises loopback): its endpoint is written here.
        plane.request("POST", "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "labels": {"kubernetes.io/service-name": "kubernetes",
                                                          "endpointslice.kubernetes.io/managed-by": "devcluster.kai-isolator.local"}},
            "addressType": "IPv4", "endpoints": [{"addresses": [node.addresses.host_ip], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": plane.port, "protocol": "TCP"}]})
        config = node.workdir / "kube-proxy.json"
        config.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(plane.admin_kubeconfig)}, "hostnameOverride": NODE_NAME, "mode": "iptables",
            "clusterCIDR": node.addresses.pod_subnet,
            # Service traffic leaves the node with the node's address, which the host's end of the veth answers.
            "iptables": {"masqueradeAll": True},
            # 0: the conntrack table's size and timeouts stay as this machine has them (they are not the node's own).
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249"}, indent=2))
        started = {"kube-proxy": node.spawn("kube-proxy", [str(binaries.kube_proxy), f"--config={config}"])}
        started["cluster-dns"] = node.spawn("cluster-dns", [sys.executable, "-m", "kai_isolator.services.devcluster.clusterdns",
                                   f"--listen={node.addresses.node_ip}:{CLUSTER_DNS_PORT}", f"--server={plane.url}",
                                   f"--ca={plane.workdir / 'ca.crt'}", f"--cert={plane.workdir / 'admin.crt'}", f"--key={plane.workdir / 'admin.key'}"])
        deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
        while "default/kubernetes:https" not in (node.exec("iptables-save", "-t", "nat").stdout or ""):
            for name, process in started.items():
                if process.poll() is not None:
                    raise NodeError(f"{name} exited:\n{(node.workdir / f'{name}.log').read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise NodeError(f"kube-proxy wrote no rule for the kubernetes Service in {PROXY_READY_TIMEOUT_S:.0f}s:\n"
                                f"{(node.workdir / 'kube-proxy.log').read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            self._daemons[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    async def _until_ready(self) -> None:
        assert self.cluster is not None and self.node is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            for name, process in self._daemons.items():
                if process.poll() is not None:
                    raise NodeError(f"{name} exited {process.returncode}:\n{(self.workdir / f'{name}.log').read_text(errors='replace')[-3000:]}")
            try:
                node = await self.cluster.get("nodes", None, NODE_NAME)
                ready = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}.get("Ready")
                gpus = node.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu", "0")
                if ready == "True" and gpus != "0":
                    return
            except ControlPlaneError:
                pass
            if time.monotonic() > deadline:
                raise NodeError(f"node {NODE_NAME} not Ready with nvidia.com/gpu after {READY_TIMEOUT_S:.0f}s:\n"
                                f"{(self.node.workdir / 'kubelet.log').read_text(errors='replace')[-3000:]}")
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        """The node first (its pods and cgroups), then the controllers and the control plane, even if the node's
        cleanup failed: that error is raised last."""
        try:
            if self.node is not None:
                await asyncio.to_thread(self.node.stop)
        finally:
            for process in self._daemons.values():
                RealNode.terminate(process)
            if self.registry is not None:
                self.registry.stop()
            if self.cluster is not None:
                await self.cluster.stop()
            if self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    async def __aenter__(self) -> RealNodeCluster:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()
