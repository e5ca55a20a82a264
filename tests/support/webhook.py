"""Our webhook behind deploy/'s Service on the real API server: TLS from the `certs` one-shot, the shipped command line.

There is no kubelet or kube-proxy: the webhook runs here as a process, and the Service's Endpoints and
EndpointSlice (which the endpoint controllers would write) point at it on this machine's routable address,
which the API server dials (`--enable-aggregator-routing`) with the Service's DNS name as TLS server name.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kai_isolator.services.devcluster.plane import ApiCallError, ControlPlane, ControlPlaneError
from kai_isolator.shared.ports import free_port

NAMESPACE = "kai-resource-isolator"  # where deploy/ installs the webhook, its Service and the certs Job

SERVICE = "kai-resource-isolator-webhook"
SECRET = "kai-resource-isolator-webhook-tls"
CLI = Path(sys.executable).with_name("kai-isolator")


def routable_address() -> str:
    """This machine's own non-loopback IPv4 address (Endpoints may not name loopback or link-local ones)."""
    for probe in ("10.255.255.255", "192.0.2.1", "172.31.255.255"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            try:
                udp.connect((probe, 9))  # UDP connect sends nothing: it only picks the outgoing address
            except OSError:
                continue
            address = udp.getsockname()[0]
            if not address.startswith(("127.", "169.254.", "0.")):
                return str(address)
    raise ControlPlaneError("no non-loopback IPv4 address on this machine for the webhook's Endpoints")


def run_certs(plane: ControlPlane, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    """`kai-isolator certs` with the certs Job's own arguments, under the given identity."""
    job = plane.request("GET", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/kai-resource-isolator-certs")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    return subprocess.run([str(CLI), *args, f"--kubeconfig={kubeconfig}"], capture_output=True, text=True, timeout=60)


def serving_pair(plane: ControlPlane, directory: Path) -> tuple[Path, Path]:
    secret = plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}")
    paths = directory / "tls.crt", directory / "tls.key"
    for path, key in zip(paths, ("tls.crt", "tls.key")):
        path.write_bytes(base64.b64decode(secret["data"][key]))
    return paths


def shipped_admission_args(plane: ControlPlane) -> list[str]:
    deployment = plane.request("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{SERVICE}")
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


class RunningWebhook:
    """`kai-isolator admission` as deploy/ runs it (its args; listen and TLS paths local), reachable through the Service."""

    def __init__(self, plane: ControlPlane, workdir: Path, nats_url: str) -> None:
        self.plane = plane
        self.workdir = workdir
        self.nats_url = nats_url
        self.address = routable_address()
        self.port = free_port()
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> RunningWebhook:
        cert, key = serving_pair(self.plane, self.workdir)
        replaced = {"--listen": f"{self.address}:{self.port}", "--tls-cert-file": str(cert), "--tls-private-key-file": str(key)}
        args = [a if a.split("=", 1)[0] not in replaced else f"{a.split('=', 1)[0]}={replaced[a.split('=', 1)[0]]}"
                for a in shipped_admission_args(self.plane)]
        env = {**os.environ, "KAI_ISOLATOR_NATS_URL": self.nats_url, "KAI_ISOLATOR_PROBE_LISTEN": f"127.0.0.1:{free_port()}"}
        self.log = open(self.workdir / "admission.log", "w")
        self.process = subprocess.Popen([str(CLI), *args], stdout=self.log, stderr=subprocess.STDOUT, env=env, text=True)
        deadline = time.monotonic() + 20
        while not self._listening():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ControlPlaneError(f"the webhook did not start:\n{(self.workdir / 'admission.log').read_text()}")
            time.sleep(0.05)
        self.point_service_here()
        return self

    def _listening(self) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex((self.address, self.port)) == 0

    def point_service_here(self) -> None:
        """What the endpoint controllers write for a ready webhook pod: its address and the `https` port."""
        ports = [{"name": "https", "port": self.port, "protocol": "TCP"}]
        endpoints = {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": SERVICE, "namespace": NAMESPACE},
                     "subsets": [{"addresses": [{"ip": self.address}], "ports": ports}]}
        slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                  "metadata": {"name": f"{SERVICE}-test", "namespace": NAMESPACE,
                               "labels": {"kubernetes.io/service-name": SERVICE,
                                          "endpointslice.kubernetes.io/managed-by": "kai-isolator-tests"}},
                  "endpoints": [{"addresses": [self.address], "conditions": {"ready": True}}], "ports": ports}
        self._put(f"/api/v1/namespaces/{NAMESPACE}/endpoints", endpoints)
        self._put(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices", slice_)

    def _put(self, collection: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        try:
            current = self.plane.request("GET", f"{collection}/{name}")
        except ApiCallError as error:
            if error.code != 404:
                raise
            self.plane.request("POST", collection, body)
            return
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        self.plane.request("PUT", f"{collection}/{name}", body)

    def output(self) -> str:
        return (self.workdir / "admission.log").read_text()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "log", None) is not None:
            self.log.close()
