"""Certificate rotation under load: new handshakes get the new pair without a restart, a
half-written pair keeps the old one serving, and no request fails throughout."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import aiohttp
from cryptography import x509

from kai_isolator.services.admission.server import AdmissionServer

from support.waiting import eventually


async def served_serial(server: AdmissionServer, context: ssl.SSLContext) -> int:
    """The serial of the certificate a fresh handshake gets."""
    host, port = server.url.removeprefix("https://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port), ssl=context, server_hostname="localhost")
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    await writer.wait_closed()
    return x509.load_der_x509_certificate(der).serial_number


def failed_reloads(server: AdmissionServer) -> float:
    return server.registry.get_sample_value("kai_isolator_admission_tls_reloads_total", {"outcome": "failed"}) or 0.0


def serial_of(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


async def test_rotation_under_load(start_webhook: Any, tls_files: Any, reviews: Any) -> None:
    gpu_pod, review_bytes = reviews
    server = await start_webhook()
    context = tls_files.client_context()
    first = serial_of(tls_files.cert.read_bytes())
    assert await served_serial(server, context) == first

    failures: list[str] = []
    answered = 0
    stop = asyncio.Event()

    async def load(fresh_connections: bool) -> None:
        nonlocal answered
        connector = aiohttp.TCPConnector(ssl=context, force_close=fresh_connections)
        async with aiohttp.ClientSession(connector=connector) as session:
            while not stop.is_set():
                try:
                    async with session.post(server.url + "/mutate", data=review_bytes(gpu_pod()),
                                            headers={"Content-Type": "application/json"}) as response:
                        if response.status != 200 or not (await response.json())["response"]["allowed"]:
                            failures.append(f"status {response.status}")
                        answered += 1
                except (aiohttp.ClientError, ssl.SSLError, OSError) as error:
                    failures.append(repr(error))

    workers = [asyncio.create_task(load(fresh)) for fresh in (True, True, False)]
    try:
        await eventually(lambda: answered >= 20)
        second_leaf = tls_files.issue()
        second = serial_of(second_leaf.cert_chain_pems[0].bytes())

        async def now_second() -> bool:
            return await served_serial(server, context) == second

        await eventually_async(now_second)

        # Half-written rotation: a new certificate beside the old key does not load.
        failed_before = failed_reloads(server)
        third_leaf = tls_files.ca.issue_cert("127.0.0.1", "localhost")
        tls_files.write(third_leaf.cert_chain_pems[0].bytes(), None)
        await eventually(lambda: failed_reloads(server) > failed_before)
        assert await served_serial(server, context) == second
        # The key arrives: the complete pair serves.
        tls_files.write(None, third_leaf.private_key_pem.bytes())
        third = serial_of(third_leaf.cert_chain_pems[0].bytes())

        async def now_third() -> bool:
            return await served_serial(server, context) == third

        await eventually_async(now_third)
        before = answered
        await eventually(lambda: answered >= before + 20)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert failures == []


async def eventually_async(check: Any, timeout_s: float = 10.0) -> None:
    result = False

    async def poll() -> None:
        nonlocal result
        while not await check():
            await asyncio.sleep(0.05)
        result = True

    await asyncio.wait_for(poll(), timeout_s)
    assert result
