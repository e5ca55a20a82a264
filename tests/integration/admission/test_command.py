"""`kai-isolator admission` as a process: flags and env configure it, it serves HTTPS, SIGTERM stops it;
and the `kai-isolator dev` component publishes a URL and CA bundle that work."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import ssl
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kai_isolator.services.admission.dev import component
from kai_isolator.services.dev import DevContext
from kai_isolator.shared.ports import free_port
from kai_isolator.shared.settings import BusSettings

CLI = [sys.executable, "-m", "kai_isolator.services.cli"]


async def test_command_serves_with_flags_and_env_and_stops_on_sigterm(tls_files: Any, nats_server: Any, reviews: Any) -> None:
    gpu_pod, review_bytes = reviews
    port = free_port()
    env = {**os.environ, "KAI_ISOLATOR_POLICY": "enforce", "KAI_ISOLATOR_NATS_URL": nats_server.url}
    process = await asyncio.create_subprocess_exec(
        *CLI, "admission", "--listen", f"127.0.0.1:{port}", "--tls-cert-file", str(tls_files.cert),
        "--tls-private-key-file", str(tls_files.key), "--container-vgpu-mount", "/opt/vgpu", "--allow-pod-opt-out", "false",
        "--grant-dir", "/srv/grants",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    url = f"https://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls_files.client_context())) as client:
            async def up() -> bool:
                try:
                    async with client.get(url + "/readyz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            deadline = asyncio.get_running_loop().time() + 60
            while not await up():
                assert process.returncode is None and asyncio.get_running_loop().time() < deadline, "webhook did not come up"
                await asyncio.sleep(0.05)
            pod = gpu_pod(**{"kai-resource-isolator.io/inject": "false"})
            async with client.post(url + "/mutate", data=review_bytes(pod), headers={"Content-Type": "application/json"}) as response:
                answer = orjson.loads(await response.read())["response"]
            patch = base64.b64decode(answer["patch"]).decode()
            assert answer["allowed"] is True and "/opt/vgpu" in patch and '"path":"/srv/grants"' in patch
            pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
            async with client.post(url + "/mutate", data=review_bytes(pod), headers={"Content-Type": "application/json"}) as response:
                answer = orjson.loads(await response.read())["response"]
            assert answer["allowed"] is False and "privileged" in answer["status"]["message"]
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(process.wait(), 30)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
            code = None
        _, stderr = await process.communicate()
    assert code == 0, stderr.decode()


@pytest.mark.parametrize(("flags", "message"), [
    (["--policy", "strict"], "invalid choice"),
    (["--allow-pod-opt-out", "maybe"], "expected true or false"),
    (["--listen", "nowhere"], "HOST:PORT"),
    (["--state-dir", "relative/dir"], "absolute path"),
    (["--grant-dir", "grants"], "absolute path"),
    (["--grant-dir", "/var/lib/kai-isolator/containers/grants"], "must not contain each other"),
    (["--tls-cert-file", "/nonexistent/tls.crt"], "cannot load TLS pair"),
])
async def test_bad_flags_fail_with_a_clear_message(flags: list[str], message: str, nats_server: Any) -> None:
    process = await asyncio.create_subprocess_exec(
        *CLI, "admission", "--nats-url", nats_server.url, *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2 and message in stderr.decode()


async def test_dev_component_publishes_a_working_url_and_ca_bundle(tmp_path: Path, bus_settings: BusSettings, reviews: Any) -> None:
    gpu_pod, review_bytes = reviews
    context = DevContext(nats_url=bus_settings.nats_url or "", bus=bus_settings, workdir=tmp_path)
    async with component(context):
        url, bundle = context.values["admission_url"], context.values["admission_ca_bundle"]
        assert url.startswith("https://127.0.0.1:") and url.endswith("/mutate") and bundle.startswith(b"-----BEGIN CERTIFICATE-----")
        trust = ssl.create_default_context(cadata=bundle.decode())
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as client:
            async with client.post(url, data=review_bytes(gpu_pod()), headers={"Content-Type": "application/json"}) as response:
                assert (await response.json())["response"]["patchType"] == "JSONPatch"
