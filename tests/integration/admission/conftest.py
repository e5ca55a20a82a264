"""A running webhook over real HTTPS (trustme certificates) and a client that trusts it."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import trustme

from kai_isolator.services.admission.server import AdmissionServer
from kai_isolator.services.admission.settings import AdmissionSettings
from kai_isolator.shared.settings import BusSettings
from support.pods import gpu_pod

ServerFactory = Callable[..., Awaitable[AdmissionServer]]


class TlsFiles:
    """A CA and the webhook's certificate files, re-issuable in place to rotate them."""

    def __init__(self, directory: Path) -> None:
        self.ca = trustme.CA()
        self.cert = directory / "tls.crt"
        self.key = directory / "tls.key"
        self.issue()

    def issue(self) -> trustme.LeafCert:
        leaf = self.ca.issue_cert("127.0.0.1", "localhost")
        self.write(leaf.cert_chain_pems[0].bytes(), leaf.private_key_pem.bytes())
        return leaf

    def write(self, cert: bytes | None, key: bytes | None) -> None:
        """Replace each file atomically (as a Secret volume update does)."""
        for path, data in ((self.cert, cert), (self.key, key)):
            if data is not None:
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(data)
                tmp.replace(path)

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


@pytest.fixture
def tls_files(tmp_path: Path) -> TlsFiles:
    return TlsFiles(tmp_path)


@pytest.fixture
async def start_webhook(tls_files: TlsFiles) -> AsyncIterator[ServerFactory]:
    servers: list[AdmissionServer] = []

    async def factory(bus: BusSettings | None = None, **overrides: Any) -> AdmissionServer:
        settings = AdmissionSettings(listen="127.0.0.1:0", tls_cert_file=tls_files.cert, tls_private_key_file=tls_files.key,
                                     tls_reload_interval_s=0.05, **overrides)
        server = AdmissionServer(settings, bus)
        await server.start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        await server.stop()


@pytest.fixture
async def client(tls_files: TlsFiles) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls_files.client_context())) as session:
        yield session


def review_pod(name: str = "train-0", namespace: str = "team-a", **annotations: str) -> dict[str, Any]:
    """A tenant's pod as these tests send it for review (support.pods.gpu_pod): half a GPU, confined by seccomp, no
    scheduler named."""
    return gpu_pod(name, namespace=namespace, gpu_memory=None, gpu_fraction="0.5", annotations=annotations, scheduler=None,
                   securityContext={"seccompProfile": {"type": "RuntimeDefault"}})


def review_bytes(pod: dict[str, Any], uid: str = "uid-1") -> bytes:
    return orjson.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
                    "namespace": pod["metadata"]["namespace"], "object": pod},
    })


@pytest.fixture
def reviews() -> Any:
    """(review_pod, review_bytes) builders."""
    return review_pod, review_bytes
