"""`kai-isolator nodeagent`: run the node agent, or install / uninstall / show the library once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kai_isolator.shared.bus import wait_for_signal
from kai_isolator.shared.embedded_nats import bus_url
from kai_isolator.shared.settings import BusSettings, ProbeSettings, load, parse_duration

from . import install
from .agent import NodeAgent
from .layout import DEFAULT_MOUNT, HostLayout
from .settings import NodeAgentSettings


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("nodeagent", help="run the node agent, or install / uninstall / show libvgpu.so on a host",
                                 description=__doc__)
    parser.add_argument("--node-name", help="this node's name (env KAI_ISOLATOR_NODE_NAME or NODE_NAME)")
    parser.add_argument("--host-root", type=Path, help="the host's / inside the agent (default /host-root)")
    parser.add_argument("--container-vgpu-mount", help=f"library directory on host and in containers (default {DEFAULT_MOUNT})")
    parser.add_argument("--proc-root", type=Path, help="the host's /proc (default /proc)")
    parser.add_argument("--library", type=Path, action="append", help="a library build the agent carries (repeatable; the first is installed when none is)")
    parser.add_argument("--self-check-command", nargs="+", help="probe run with LD_PRELOAD=libvgpu.so (default: check /proc/self/maps)")
    parser.add_argument("--gc-grace-s", type=float, help="keep a retired version at least this long (default 60)")
    parser.add_argument("--status-interval-s", type=float, help="self-check and status period (default 30)")
    parser.add_argument("--usage-interval-s", type=float, help="usage scan period (default 15)")
    parser.add_argument("--grant-dir", help="host directory of per-container grants, under --host-root (default /var/lib/kai-isolator/grants)")
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig for reading this node's pods, their ConfigMaps and the node (default: in-cluster)")
    parser.add_argument("--reservation-namespace",
                        help="KAI's namespace for its GPU reservation pods, its binder's --resource-reservation-namespace (default kai-resource-reservation)")
    parser.add_argument("--enforce", action=argparse.BooleanOptionalAction, default=None,
                        help="hold containers to their grants from the driver's view (default on; --no-enforce turns it off)")
    parser.add_argument("--enforce-interval", dest="enforce_interval_s", type=parse_duration,
                        help="NVML poll period of the enforcer, e.g. 1s or 500ms (default 1s)")
    parser.add_argument("--on-breach", choices=["kill", "evict", "warn"],
                        help="what a container over its grant gets: kill its biggest processes (default), evict the pod, or warn")
    parser.add_argument("--breach-tolerance-mib", type=int,
                        help="allowed over the grant per container and device, however many processes it runs, for the driver's context reservations (default 512)")
    parser.add_argument("--nvml-library", help="NVML library the enforcer loads (default libnvidia-ml.so.1)")
    parser.add_argument("--probe-listen", help="HOST:PORT for /healthz, /readyz, /metrics (default 0.0.0.0:8081)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    one = actions.add_parser("install", help="install a library file and make it active, then exit")
    one.add_argument("--host-root", type=Path, required=True, dest="one_host_root")
    one.add_argument("--library", type=Path, required=True, dest="one_library", help="libvgpu.so build to install")
    one.add_argument("--container-vgpu-mount", default=DEFAULT_MOUNT, dest="one_mount")

    gone = actions.add_parser("uninstall", help="stop preloading, then remove every version no process uses")
    gone.add_argument("--host-root", type=Path, required=True, dest="one_host_root")
    gone.add_argument("--container-vgpu-mount", default=DEFAULT_MOUNT, dest="one_mount")
    gone.add_argument("--proc-root", type=Path, default=Path("/proc"), dest="one_proc_root")

    show = actions.add_parser("status", help="show what is installed and what is wrong with it")
    show.add_argument("--host-root", type=Path, required=True, dest="one_host_root")
    show.add_argument("--container-vgpu-mount", default=DEFAULT_MOUNT, dest="one_mount")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


async def run(args: argparse.Namespace) -> int:
    if args.action == "install":
        layout = HostLayout(args.one_host_root, args.one_mount)
        version = install.install(layout, args.one_library)
        print(f"installed libvgpu.so.{version} in {layout.install_dir}")
        return 0
    if args.action == "uninstall":
        result = install.uninstall(HostLayout(args.one_host_root, args.one_mount), args.one_proc_root)
        print(f"removed: {', '.join(result.removed) or 'nothing'}")
        if not result.complete:
            print(f"still in use (kept; run again once these processes exit): {', '.join(result.still_in_use)}", file=sys.stderr)
            return 3
        return 0
    if args.action == "status":
        state = install.status(HostLayout(args.one_host_root, args.one_mount))
        if args.json:
            print(state.model_dump_json())
        else:
            print(_render(state))
        return 0 if state.installed else 1
    return await _serve(args)


def _render(state: install.InstallStatus) -> str:
    lines = [
        f"install dir:  {state.install_dir}",
        f"installed:    {'yes' if state.installed else 'no'}",
        f"active:       {state.active_version or '-'}",
        f"versions:     {', '.join(state.installed_versions) or '-'}",
        f"preload:      {state.preload}",
        f"gpus:         {state.gpu_count}",
    ]
    lines += [f"problem:      {p}" for p in state.problems]
    return "\n".join(lines)


async def _serve(args: argparse.Namespace) -> int:
    settings = load(NodeAgentSettings, args)
    if not settings.node_name:
        settings = settings.model_copy(update={"node_name": os.environ.get("NODE_NAME")})
    bus = load(BusSettings, args)
    probe = load(ProbeSettings, args)
    agent = NodeAgent(settings, bus, probe.probe_listen)
    async with bus_url(bus) as url:
        await agent.start(url)
        print(json.dumps({"node": agent.node, "metrics": agent.runtime.probe_url + "/metrics"}), flush=True)
        await wait_for_signal()
        await agent.stop()
    return 0
