"""`kai-isolator verifier`: prove isolation is really active in every running GPU-sharing container."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

from kai_isolator.shared.bus import Runtime, wait_for_signal
from kai_isolator.shared.embedded_nats import bus_url
from kai_isolator.shared.lease import LEASE_BUCKET, Lease, holder_name
from kai_isolator.shared.settings import BusSettings, ProbeSettings, load, parse_duration
from kai_isolator.shared.tasks import cancel_all

from .kube import PodNotifier
from .service import Verifier
from .settings import VerifierSettings

SERVICE = "verifier"


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("verifier", help="verify running GPU-sharing pods and publish health verdicts", description=__doc__)
    parser.add_argument("--kubeconfig", help="kubeconfig for Events (default: in-cluster; env KAI_ISOLATOR_VERIFIER_KUBECONFIG)")
    parser.add_argument("--reverify", dest="reverify_s", type=parse_duration, help="re-inspect running pods this often, e.g. 5m (default 300s)")
    parser.add_argument("--on-missing", choices=["warn", "annotate", "evict"],
                        help="warn: Warning Event (default); annotate: also mark the pod; evict: also evict it (Eviction API, honours PDBs)")
    parser.add_argument("--container-vgpu-mount", help="library directory inside containers (default /usr/local/vgpu)")
    parser.add_argument("--no-kubernetes-events", dest="kubernetes_events", action="store_const", const=False, help="publish verdicts on the bus only")
    parser.add_argument("--no-pod-condition", dest="pod_condition", action="store_const", const=False,
                        help="do not write the pod condition kai-resource-isolator.io/Isolated")
    parser.add_argument("--no-node-views", dest="node_views", action="store_const", const=False,
                        help="do not annotate GPU Nodes with the node agents' status and usage")
    parser.add_argument("--probe-listen", dest="probe_listen", help="HOST:PORT for /healthz /readyz /metrics (default 0.0.0.0:8081)")
    return parser


@contextlib.asynccontextmanager
async def running(settings: VerifierSettings, bus: BusSettings, url: str, probe_listen: str | None = None) -> AsyncIterator[Verifier]:
    """A started runtime + verifier for the block; stopped gracefully on exit."""
    notifier = await PodNotifier.connect(settings.kubeconfig) if settings.kubernetes_events else None
    runtime = Runtime(SERVICE, bus, kv_buckets=(settings.health_bucket, LEASE_BUCKET), probe_listen=probe_listen)
    verifier = Verifier(runtime, settings, notifier)
    verifier.bind()
    await runtime.start(url)
    lease = verifier.pass_lease = Lease(runtime.kv(LEASE_BUCKET), "verifier.passes", holder_name(SERVICE), settings.reverify_lease_ttl_s)
    loops = [asyncio.create_task(verifier.lead_passes_forever()), asyncio.create_task(verifier.reverify_forever())]
    if verifier.views is not None:
        loops.append(asyncio.create_task(verifier.views.flush_forever(settings.node_view_interval_s, verifier.views_leading)))
    try:
        yield verifier
    finally:
        await cancel_all(loops)
        await lease.release()  # another replica runs the passes at once, not after the ttl
        await runtime.stop()
        if notifier:
            await notifier.close()


async def run(args: argparse.Namespace) -> int:
    settings = load(VerifierSettings, args)
    bus = load(BusSettings, args)
    probes = load(ProbeSettings, args)
    async with bus_url(bus) as url, running(settings, bus, url, probes.probe_listen):
        await wait_for_signal()
    return 0
