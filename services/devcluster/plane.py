"""A real etcd + kube-apiserver on loopback: generated PKI, RBAC on, kubeconfigs for an admin and any ServiceAccount.

`ControlPlane(binaries, workdir).start()` is ready in seconds from the build cache; `stop()` leaves nothing running.
`restart_apiserver()` and `compact_etcd()` are the faults the watcher tests need.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from kai_isolator.shared.pki import CertificateAuthority, private_key_pem, public_key_pem
from kai_isolator.shared.ports import free_port

from .build import Binaries

SERVICE_CIDR = "10.0.0.0/24"
# kube-apiserver leaves on SIGTERM at once, unless a watch is open: then it waits up to a minute for it to end.
APISERVER_GRACE_S = 2.0
ISSUER = "https://kubernetes.default.svc.cluster.local"


class ControlPlaneError(RuntimeError):
    """The control plane did not start, or a call to it failed; the message carries the server's log tail or reply."""


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ApiCallError(ControlPlaneError):
    """A non-2xx answer from the API server, with its Status object."""

    def __init__(self, method: str, path: str, code: int, status: dict[str, Any]) -> None:
        super().__init__(f"{method} {path}: HTTP {code}: {status.get('message', status)}")
        self.code = code
        self.status = status


class ApiClient:
    """JSON REST calls as one identity (a client certificate or a bearer token); a non-2xx answer raises ApiCallError."""

    def __init__(self, url: str, ca_file: Path, cert_file: Path | None = None, key_file: Path | None = None, token: str = "") -> None:
        self.url = url
        self.ssl = ssl.create_default_context(cafile=str(ca_file))
        if cert_file is not None:
            self.ssl.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json", timeout_s: float = 10) -> Any:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, context=self.ssl, timeout=timeout_s) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                status = json.loads(raw)
            except ValueError:
                status = {"message": raw.decode(errors="replace")}
            raise ApiCallError(method, path, error.code, status) from None
        return json.loads(raw) if raw else None


class ControlPlane:
    """etcd and kube-apiserver as child processes in their own sessions (so stop() kills whatever they started)."""

    def __init__(self, binaries: Binaries, workdir: Path, *, bind_address: str = "127.0.0.1", port: int = 0,
                 hosts: tuple[str, ...] = ()) -> None:
        self.binaries = binaries
        self.workdir = Path(workdir)
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.bind_address = bind_address
        self.port = port or free_port()
        self.hosts = hosts  # names besides loopback the serving certificate must carry (a compose service name)
        # Loopback unless it serves on one address of its own (the host's end of a real node's veth).
        self.url = f"https://{bind_address if bind_address not in ('0.0.0.0', '::', '127.0.0.1') else '127.0.0.1'}:{self.port}"
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self.startup_s: dict[str, float] = {}
        self._write_pki()
        self.admin_kubeconfig = self._write_kubeconfig("admin", self.admin_user())

    # --- PKI and kubeconfigs -----------------------------------------------------------

    def _write_pki(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ca = CertificateAuthority("kai-isolator local control plane")
        self.ca_pem = ca.cert_pem
        (self.workdir / "ca.crt").write_bytes(ca.cert_pem)
        ca.issue_server(["127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "10.0.0.1", *self.hosts]).write(
            self.workdir / "apiserver.crt", self.workdir / "apiserver.key")
        # system:masters is the group the API server's bootstrap RBAC binds to cluster-admin.
        ca.issue_client("kai-isolator-admin", "system:masters").write(self.workdir / "admin.crt", self.workdir / "admin.key")
        # What kube-apiserver shows a kubelet it calls (logs, exec): kubeadm's apiserver-kubelet-client.
        ca.issue_client("kube-apiserver-kubelet-client", "system:masters").write(self.workdir / "kubelet-client.crt",
                                                                                 self.workdir / "kubelet-client.key")
        signing = ec.generate_private_key(ec.SECP256R1())
        (self.workdir / "sa.key").write_bytes(private_key_pem(signing))
        (self.workdir / "sa.pub").write_bytes(public_key_pem(signing))
        self._ca = ca
        self.admin = ApiClient(self.url, self.workdir / "ca.crt", self.workdir / "admin.crt", self.workdir / "admin.key")

    @staticmethod
    def _b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    def _write_kubeconfig(self, name: str, user: dict[str, str], namespace: str = "default") -> Path:
        return self.write_kubeconfig(self.workdir / "kubeconfigs" / f"{name}.yaml", name, user, namespace)

    def write_kubeconfig(self, path: Path, name: str, user: dict[str, str], namespace: str = "default", server: str | None = None) -> Path:
        """A kubeconfig for `user` at `path` (0600, written whole: a reader never sees half a file)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": name, "preferences": {},
            "clusters": [{"name": "local", "cluster": {"server": server or self.url,
                                                       "certificate-authority-data": base64.b64encode(self.ca_pem).decode()}}],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": name, "context": {"cluster": "local", "user": name, "namespace": namespace}}],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML: no YAML library needed
        partial.chmod(0o600)
        partial.replace(path)
        return path

    def admin_user(self) -> dict[str, str]:
        return {"client-certificate-data": self._b64(self.workdir / "admin.crt"), "client-key-data": self._b64(self.workdir / "admin.key")}

    def service_account_token(self, namespace: str, name: str, expiration_s: int = 3600) -> str:
        """A token from the TokenRequest API, as the kubelet gets one for a pod running as the ServiceAccount."""
        review = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                              {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": expiration_s}})
        return str(review["status"]["token"])

    def service_account_kubeconfig(self, namespace: str, name: str, expiration_s: int = 3600) -> Path:
        """A kubeconfig that authenticates as the ServiceAccount (a TokenRequest token)."""
        return self._write_kubeconfig(f"{namespace}.{name}", {"token": self.service_account_token(namespace, name, expiration_s)}, namespace)

    def service_account_client(self, namespace: str, name: str) -> ApiClient:
        return ApiClient(self.url, self.workdir / "ca.crt", token=self.service_account_token(namespace, name))

    # --- REST, as the admin ------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json", timeout_s: float = 10) -> Any:
        return self.admin.request(method, path, body, content_type=content_type, timeout_s=timeout_s)

    def node_client(self, node: str) -> ApiClient:
        """A client that is the node's kubelet to the API server (system:node:<node>, group system:nodes): the Node authorizer's user."""
        return ApiClient(self.url, self.workdir / "ca.crt", *self.node_credentials(node))

    def node_credentials(self, node: str) -> tuple[Path, Path]:
        """A client certificate and key for the node's kubelet (system:node:<node>, group system:nodes)."""
        return self._ca.issue_client(f"system:node:{node}", "system:nodes").write(
            self.workdir / f"node-{node}.crt", self.workdir / f"node-{node}.key")

    def kubectl(self, *args: str, kubeconfig: Path | None = None, input_text: str | None = None, check: bool = True,
                timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """kubectl as users run it (default validation, protobuf where kubectl uses it), against this API server."""
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.admin_kubeconfig), "HOME": str(self.workdir)}
        done = subprocess.run([str(self.binaries.kubectl), *args], input=input_text, capture_output=True, text=True,
                              env=env, timeout=timeout_s)
        if check and done.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stderr}{done.stdout}")
        return done

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> ControlPlane:
        try:
            self._start_etcd()
            self._start_apiserver()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def _start_etcd(self) -> None:
        started = time.monotonic()
        self._etcd = self._spawn("etcd", [
            str(self.binaries.etcd), "--name=test", f"--data-dir={self.workdir / 'etcd-data'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{self.etcd_peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{self.etcd_peer_port}",
            f"--initial-cluster=test=http://127.0.0.1:{self.etcd_peer_port}",
            # A throwaway store: fsync buys nothing in a test and costs seconds on a shared disk.
            "--unsafe-no-fsync", "--log-level=warn",
        ])
        self._wait("etcd", self._etcd, lambda: self._etcd_healthy(), timeout_s=30)
        self.startup_s["etcd"] = time.monotonic() - started

    def _etcd_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.etcd_url + "/health", timeout=1) as answer:
                return json.loads(answer.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def apiserver_args(self) -> list[str]:
        return [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.bind_address}", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--tls-cert-file={self.workdir / 'apiserver.crt'}", f"--tls-private-key-file={self.workdir / 'apiserver.key'}",
            f"--client-ca-file={self.workdir / 'ca.crt'}",
            f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={self.workdir / 'sa.pub'}",
            f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            # The default admission plugins (MutatingAdmissionWebhook among them), plus NodeRestriction, which every
            # kubeadm and managed cluster adds: without it a kubelet could write any pod's status.
            "--enable-admission-plugins=NodeRestriction",
            # Webhooks are reached through their Service's endpoints, as a cluster with no kube-proxy needs.
            "--enable-aggregator-routing=true",
            "--allow-privileged=true",  # the node agent's DaemonSet is privileged, as on a real cluster
            "--profiling=false",
            # The `kubernetes` Service's endpoints would name 127.0.0.1, which Endpoints refuse; nothing here dials it.
            "--endpoint-reconciler-type=none",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--kubelet-client-certificate={self.workdir / 'kubelet-client.crt'}", f"--kubelet-client-key={self.workdir / 'kubelet-client.key'}",
            # A node's name resolves nowhere here; its InternalIP is where its kubelet listens.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
        ]

    def _start_apiserver(self, label: str = "kube-apiserver") -> None:
        started = time.monotonic()
        self._apiserver = self._spawn("kube-apiserver", self.apiserver_args())
        self._wait("kube-apiserver", self._apiserver, self._apiserver_ready, timeout_s=60)
        self.startup_s[label] = time.monotonic() - started

    def _apiserver_ready(self) -> bool:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + "/readyz"), context=self.admin.ssl, timeout=1) as answer:
                return answer.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def _wait(self, name: str, process: subprocess.Popen[bytes], ready: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if process.poll() is not None:
                raise ControlPlaneError(f"{name} exited {process.returncode} while starting:\n{_tail(self.workdir / f'{name}.log')}")
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{name} not ready after {timeout_s:.0f}s:\n{_tail(self.workdir / f'{name}.log')}")
            time.sleep(0.05)

    @staticmethod
    def _terminate(process: subprocess.Popen[bytes] | None, grace_s: float = 10) -> None:
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        except ProcessLookupError:
            pass

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver (every watch on it ends) and start it again on the same port and store."""
        self._terminate(self._apiserver, APISERVER_GRACE_S)
        self._start_apiserver("kube-apiserver restart")

    def stop(self) -> None:
        self._terminate(self._apiserver, APISERVER_GRACE_S)
        self._terminate(self._etcd)

    @property
    def running(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self._etcd, self._apiserver))

    # --- etcd, directly ----------------------------------------------------------------

    def _etcd_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.etcd_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as answer:
            return json.loads(answer.read())

    def etcd_revision(self) -> int:
        # etcd's JSON gateway (gRPC's KV.Range): any key will do, the header carries the store's revision.
        reply = self._etcd_call("/v3/kv/range", {"key": base64.b64encode(b"/").decode(), "limit": 1})
        return int(reply["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now, as the API server does every five minutes; returns the revision."""
        revision = self.etcd_revision()
        self._etcd_call("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision
