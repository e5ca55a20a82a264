"""`kai-isolator devcluster`: run the local control plane (a DEV AND TEST FIXTURE) until Ctrl-C."""

from __future__ import annotations

import argparse
from pathlib import Path

from kai_isolator.shared.bus import wait_for_signal
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.settings import load

from .cluster import DevCluster
from .settings import DevClusterSettings

DESCRIPTION = """Run a real etcd + kube-apiserver (built once from pinned Go modules into ~/.cache/kai-isolator/kube)
with KAI-Scheduler's admission, scheduler and binder and GPU nodes' kubelets simulated through its API:
a DEV AND TEST FIXTURE, not a cluster. RBAC and the default admission plugins are on; the admin
kubeconfig it writes holds a system:masters client certificate, so keep the port to yourself."""


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("devcluster", help="run a local kube-apiserver with simulated KAI and GPU nodes (dev/test fixture)",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", help="HOST:PORT kube-apiserver serves on (default 127.0.0.1:0, env KAI_ISOLATOR_DEVCLUSTER_LISTEN)")
    parser.add_argument("--kubeconfig", help="write the admin kubeconfig to FILE (env KAI_ISOLATOR_DEVCLUSTER_KUBECONFIG)")
    parser.add_argument("--server-name", dest="server_name", help="name the server so in that kubeconfig and its certificate (a compose service)")
    parser.add_argument("--workdir", help="etcd data, PKI and logs here (default: a temporary directory)")
    parser.add_argument("--gpu-node", dest="gpu_nodes", action="append", metavar="NAME[:MIB]",
                        help="a simulated GPU node (repeatable; default gpu-node-1:15360)")
    parser.add_argument("--step", dest="step_s", type=float, help="simulated scheduling / start delay in seconds (default 0.2)")
    parser.add_argument("--real-node", dest="real_node", action="store_true", default=None,
                        help="instead of simulated nodes, one real GPU node (gpu-node-1): kube-controller-manager, kube-scheduler, "
                             "kubelet, containerd and runc in the node's own namespaces, its GPU faked at the driver level; needs root "
                             "and Debian's runc (env KAI_ISOLATOR_DEVCLUSTER_REAL_NODE)")
    return parser


async def run(args: argparse.Namespace) -> int:
    if args.gpu_nodes:
        args.gpu_nodes = tuple(args.gpu_nodes)
    settings = load(DevClusterSettings, args)
    if settings.real_node:
        ignored = [flag for flag, value in (("--gpu-node", args.gpu_nodes), ("--listen", args.listen), ("--server-name", args.server_name),
                                            ("--step", args.step_s)) if value is not None]
        if ignored:
            raise ConfigError(f"--real-node runs one real node (gpu-node-1) and serves on its veth: {', '.join(ignored)} cannot apply")
        return await _run_real_node(settings)
    async with DevCluster(workdir=settings.workdir, nodes=settings.node_specs(), step_s=settings.step_s, listen=settings.listen,
                          server_name=settings.server_name) as cluster:
        where = ""
        if settings.kubeconfig:
            port = cluster.url.rsplit(":", 1)[1]
            server = f"https://{settings.server_name}:{port}" if settings.server_name else None
            cluster.write_kubeconfig(Path(settings.kubeconfig), server)
            where = f"; kubeconfig {settings.kubeconfig}"
        print(f"kai-isolator devcluster (dev/test fixture): kube-apiserver at {cluster.url}{where}; Ctrl-C to stop", flush=True)
        await wait_for_signal()
    return 0


async def _run_real_node(settings: DevClusterSettings) -> int:
    from .realcluster import NODE_NAME, RealNodeCluster  # grpc and the node's modules: only when asked for

    async with RealNodeCluster(workdir=settings.workdir) as real:
        assert real.cluster is not None
        where = ""
        if settings.kubeconfig:
            real.cluster.write_kubeconfig(Path(settings.kubeconfig))
            where = f"; kubeconfig {settings.kubeconfig}"
        phases = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in real.startup_s.items())
        assert real.registry is not None
        print(f"kai-isolator devcluster (dev/test fixture): kube-apiserver at {real.cluster.url}, real node {NODE_NAME} Ready "
              f"({phases}){where}; its images from the registry at {real.registry.describe()}, which the node's mirrors "
              f"for docker.io, ghcr.io and nvcr.io name; Ctrl-C to stop", flush=True)
        await wait_for_signal()
    return 0
