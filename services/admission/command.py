"""`kai-isolator admission`: serve the mutating webhook that injects libvgpu.so into GPU-sharing pods."""

from __future__ import annotations

import argparse

from kai_isolator.shared.bus import wait_for_signal
from kai_isolator.shared.embedded_nats import bus_url
from kai_isolator.shared.settings import BusSettings, load

from .server import AdmissionServer
from .settings import AdmissionSettings


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("admission", help="serve the mutating admission webhook (HTTPS)", description=__doc__)
    parser.add_argument("--listen", metavar="HOST:PORT", help="env KAI_ISOLATOR_LISTEN (default 0.0.0.0:8443)")
    parser.add_argument("--tls-cert-file", metavar="F", help="PEM certificate, reloaded when it changes (env KAI_ISOLATOR_TLS_CERT_FILE, default /etc/tls/tls.crt)")
    parser.add_argument("--tls-private-key-file", metavar="F", help="PEM key (env KAI_ISOLATOR_TLS_PRIVATE_KEY_FILE, default /etc/tls/tls.key)")
    parser.add_argument("--container-vgpu-mount", metavar="DIR", help="node dir of libvgpu.so, mounted read-only at the same path (env KAI_ISOLATOR_CONTAINER_VGPU_MOUNT, default /usr/local/vgpu)")
    parser.add_argument("--state-dir", metavar="DIR", help="node dir of per-container state dirs (env KAI_ISOLATOR_STATE_DIR, default /var/lib/kai-isolator/containers)")
    parser.add_argument("--grant-dir", metavar="DIR", help="node dir of per-container grants the node agent writes, mounted read-only at /etc/kai-isolator (env KAI_ISOLATOR_GRANT_DIR, default /var/lib/kai-isolator/grants)")
    parser.add_argument("--policy", choices=["enforce", "warn", "off"], help="tenant-escape policy (env KAI_ISOLATOR_POLICY, default warn)")
    parser.add_argument("--allow-pod-opt-out", type=parse_bool, metavar="true|false", help="honour kai-resource-isolator.io/inject=false (env KAI_ISOLATOR_ALLOW_POD_OPT_OUT, default true)")
    return parser


async def run(args: argparse.Namespace) -> int:
    settings = load(AdmissionSettings, args)
    bus = load(BusSettings, args)
    async with bus_url(bus) as url:
        server = AdmissionServer(settings, bus.model_copy(update={"nats_url": url}))
        await server.start()
        print(f"kai-isolator admission: serving {server.url}/mutate (policy {settings.policy})", flush=True)
        try:
            await wait_for_signal()
        finally:
            await server.stop()
    return 0
