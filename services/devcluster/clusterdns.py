"""The real node's cluster DNS: Service names (`<svc>.<ns>.svc.cluster.local`) answered from the API, as CoreDNS's
kubernetes plugin answers them (no CoreDNS image can be pulled here). A DEV AND TEST FIXTURE.

A records only, from the Service's ClusterIP, or for a headless Service its ready endpoints (and
`<hostname>.<svc>.<ns>.svc...` for a StatefulSet's pods). Any other name gets NXDOMAIN inside the cluster domain and
REFUSED outside it: nothing is forwarded, so no query leaves the machine.
`python -m kai_isolator.services.devcluster.clusterdns --listen IP:PORT --server URL --ca F --cert F --key F`
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from .plane import ApiCallError, ApiClient

TTL_S = 5
NOERROR, NXDOMAIN, REFUSED, FORMERR = 0, 3, 5, 1
TYPE_A, TYPE_AAAA, CLASS_IN = 1, 28, 1


@dataclass(frozen=True)
class Question:
    id: int
    flags: int
    name: str  # lower case, no trailing dot
    qtype: int
    raw: bytes  # the question section as sent, echoed in the answer


def parse(packet: bytes) -> Question:
    """The first question of a query; ValueError on anything malformed."""
    if len(packet) < 12:
        raise ValueError("short header")
    ident, flags, questions = struct.unpack("!HHH", packet[:6])
    if questions < 1 or flags & 0x8000:
        raise ValueError("not a query")
    labels, at = [], 12
    while True:
        if at >= len(packet):
            raise ValueError("truncated name")
        length = packet[at]
        at += 1
        if length == 0:
            break
        if length > 63:
            raise ValueError("compressed or oversized label in a question")
        labels.append(packet[at:at + length].decode("ascii", "replace").lower())
        at += length
    if at + 4 > len(packet):
        raise ValueError("truncated question")
    qtype, _qclass = struct.unpack("!HH", packet[at:at + 4])
    return Question(ident, flags, ".".join(labels), qtype, packet[12:at + 4])


def answer(question: Question, rcode: int, addresses: list[str]) -> bytes:
    # QR, AA, RA, the opcode and RD of the query echoed.
    flags = 0x8000 | 0x0400 | 0x0080 | (question.flags & 0x7900) | rcode
    body = b"".join(struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL_S, 4) + ipaddress.IPv4Address(a).packed for a in addresses)
    return struct.pack("!HHHHHH", question.id, flags, 1, len(addresses), 0, 0) + question.raw + body


class Resolver:
    """Names of the cluster domain to IPv4 addresses, through the API server (cached for TTL_S)."""

    def __init__(self, api: ApiClient, domain: str = "cluster.local") -> None:
        self.api = api
        self.domain = domain
        self._cache: dict[str, tuple[float, list[str] | None]] = {}

    def lookup(self, name: str) -> list[str] | None:
        """Addresses of `name`, [] for a name that exists with none, None for one that does not."""
        cached = self._cache.get(name)
        if cached and cached[0] > time.monotonic():
            return cached[1]
        found = self._lookup(name)
        self._cache[name] = (time.monotonic() + TTL_S, found)
        return found

    def _lookup(self, name: str) -> list[str] | None:
        labels = name.removesuffix(f".{self.domain}").split(".")
        if labels[-1:] != ["svc"] or len(labels) not in (3, 4):
            return None
        host, service, namespace = (labels[0] if len(labels) == 4 else None), labels[-3], labels[-2]
        try:
            spec = self.api.request("GET", f"/api/v1/namespaces/{quote(namespace)}/services/{quote(service)}")["spec"]
        except ApiCallError:
            return None
        if host is None and spec.get("clusterIP") not in (None, "", "None"):
            return [spec["clusterIP"]]
        slices = self.api.request("GET", f"/apis/discovery.k8s.io/v1/namespaces/{quote(namespace)}/endpointslices"
                                         f"?labelSelector={quote(f'kubernetes.io/service-name={service}')}")["items"]
        ready_only = not spec.get("publishNotReadyAddresses")
        addresses = [a for s in slices if s.get("addressType") == "IPv4" for e in s.get("endpoints") or []
                     if (host is None or e.get("hostname") == host) and (not ready_only or e.get("conditions", {}).get("ready", True))
                     for a in e.get("addresses", [])]
        return addresses if addresses or host is None else None

    def respond(self, packet: bytes) -> bytes | None:
        try:
            question = parse(packet)
        except ValueError:
            return None  # not worth an answer: a resolver retries or gives up
        if question.name != self.domain and not question.name.endswith(f".{self.domain}"):
            return answer(question, REFUSED, [])
        try:
            found = self.lookup(question.name)
        except (OSError, ApiCallError, KeyError, ValueError) as error:
            print(f"clusterdns: {question.name}: {error}", file=sys.stderr, flush=True)
            return answer(question, 2, [])  # SERVFAIL: the resolver tries again
        if found is None:
            return answer(question, NXDOMAIN, [])
        return answer(question, NOERROR, found if question.qtype == TYPE_A else [])


def serve(listen: str, resolver: Resolver) -> None:
    host, _, port = listen.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind((host, int(port)))
        print(f"clusterdns: serving {resolver.domain} on {listen}/udp", file=sys.stderr, flush=True)
        while True:
            packet, peer = udp.recvfrom(4096)
            reply = resolver.respond(packet)
            if reply is not None:
                udp.sendto(reply, peer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clusterdns", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="IP:PORT (UDP)")
    parser.add_argument("--server", required=True, help="the API server's URL")
    parser.add_argument("--ca", type=Path, required=True)
    parser.add_argument("--cert", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--domain", default="cluster.local")
    args = parser.parse_args(argv)
    serve(args.listen, Resolver(ApiClient(args.server, args.ca, args.cert, args.key), args.domain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
