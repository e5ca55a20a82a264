"""`kai-isolator sandbox`: run the sandbox Kubernetes API server, a TEST AND DEMO FIXTURE, until Ctrl-C."""

from __future__ import annotations

import argparse

from kai_isolator.shared.bus import wait_for_signal
from kai_isolator.shared.settings import load

from .api import SandboxApi
from .settings import SandboxSettings

DESCRIPTION = """Run the sandbox Kubernetes API server: a TEST AND DEMO FIXTURE, not a cluster.

It serves a faithful subset of kube-apiserver (pods, namespaces, nodes, configmaps, events,
mutatingwebhookconfigurations; list/watch with resourceVersions, bookmarks and 410 Gone;
selectors; patches; mutating admission over HTTPS) on plain HTTP with no authentication,
plus simulated GPU nodes, and writes a kubeconfig for itself so kubectl and the services
can talk to it. Never expose it beyond 127.0.0.1."""


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("sandbox", help="run the sandbox Kubernetes API (test/demo fixture)", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:0, env KAI_ISOLATOR_SANDBOX_LISTEN)")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for this server to FILE (env KAI_ISOLATOR_SANDBOX_KUBECONFIG)")
    parser.add_argument("--retained-events", dest="retained_events", type=int, help="changes kept for watches; older versions get 410 Gone (default 10000)")
    parser.add_argument("--bookmark-interval", dest="bookmark_interval_s", type=float, help="seconds between watch bookmarks (default 30)")
    parser.add_argument("--node-step", dest="node_step_s", type=float, help="simulated scheduling / start delay in seconds (default 0.2)")
    parser.add_argument("--gpu-node", dest="gpu_nodes", action="append", metavar="NAME[:MIB]", help="a simulated GPU node (repeatable; default gpu-node-1:15360)")
    return parser


async def run(args: argparse.Namespace) -> int:
    if args.gpu_nodes:
        args.gpu_nodes = tuple(args.gpu_nodes)
    settings = load(SandboxSettings, args)
    async with SandboxApi(settings) as api:
        where = f"; kubeconfig {settings.kubeconfig}" if settings.kubeconfig else ""
        print(f"kai-isolator sandbox (test/demo fixture): serving {api.url}{where}; Ctrl-C to stop", flush=True)
        await wait_for_signal()
    return 0
