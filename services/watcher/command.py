"""`kai-isolator watcher`: publish every GPU-sharing pod's isolation story from the Kubernetes API to the bus."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from kai_isolator.shared.bus import Runtime, wait_for_signal
from kai_isolator.shared.embedded_nats import bus_url
from kai_isolator.shared.lease import LEASE_BUCKET, Lease, holder_name
from kai_isolator.shared.settings import BusSettings, ProbeSettings, load
from kai_isolator.shared.tasks import cancel_all

from .kube import KubeClient, load_endpoint
from .service import PodWatcher
from .settings import WatcherSettings

SERVICE = "watcher"
GRACEFUL_STOP_S = 20.0
"""Well inside a pod's default 30 s grace period."""
log = logging.getLogger(__name__)


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("watcher", help="watch pods and publish their isolation events", description=__doc__)
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube/config; env KAI_ISOLATOR_WATCHER_KUBECONFIG)")
    parser.add_argument("--node", help="watch only pods on this node (env KAI_ISOLATOR_WATCHER_NODE)")
    parser.add_argument("--lease-ttl-s", dest="lease_ttl_s", type=float, help="replicas are active/standby: a standby takes over after this long without renewal (default 10; env KAI_ISOLATOR_WATCHER_LEASE_TTL_S)")
    parser.add_argument("--probe-listen", dest="probe_listen", help="HOST:PORT for /healthz /readyz /metrics (default 0.0.0.0:8081)")
    return parser


@contextlib.asynccontextmanager
async def running(settings: WatcherSettings, bus: BusSettings, url: str, probe_listen: str | None = None) -> AsyncIterator[PodWatcher]:
    """A started runtime + watcher for the block; stopped gracefully on exit."""
    runtime = Runtime(SERVICE if not settings.node else f"{SERVICE}-{settings.node}", bus,
                      kv_buckets=(settings.resume_bucket, settings.state_bucket, LEASE_BUCKET), probe_listen=probe_listen)
    api = KubeClient(load_endpoint(settings.kubeconfig))  # a bad kubeconfig fails fast, before waiting on the bus
    try:
        await runtime.start(url)
    except BaseException:
        await api.close()
        raise
    # One lease per scope: replicas of the same scope are active/standby; other scopes run side by side.
    lease = Lease(runtime.kv(LEASE_BUCKET), f"watcher.{settings.scope}", holder_name(SERVICE), settings.lease_ttl_s)
    watcher = PodWatcher(runtime, settings, api, lease)
    task = asyncio.create_task(watcher.run())
    try:
        yield watcher
    finally:
        watcher.stop()
        await stopped(task)
        await api.close()
        await runtime.stop()


async def stopped(task: asyncio.Task[None]) -> None:
    """Wait for the graceful stop, within a bound: past it the watcher is ended as by a crash, which loses
    nothing (KV holds every fully handled change), so a stop never hangs a pod's termination."""
    try:
        done, _ = await asyncio.wait({task}, timeout=GRACEFUL_STOP_S)
    except asyncio.CancelledError:
        await cancel_all((task,))
        raise
    if not done:
        log.warning("graceful stop did not end in time; ending the watcher abruptly", extra={"after_s": GRACEFUL_STOP_S})
        await cancel_all((task,))
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


async def run(args: argparse.Namespace) -> int:
    settings = load(WatcherSettings, args)
    bus = load(BusSettings, args)
    probes = load(ProbeSettings, args)
    async with bus_url(bus) as url, running(settings, bus, url, probes.probe_listen):
        await wait_for_signal()
    return 0
