"""A real OCI registry on this machine, and what points clients at it as if it were the registries users name.

`OciRegistry` runs CNCF Distribution's `registry` (built from its pinned module by build.py) serving TLS on one address
only, port 443, from a CA generated in its work dir; what it stores lives in a folder of a work dir or the cache. The
registries users write in image and chart names (docker.io, ghcr.io, nvcr.io) reach it the ways a machine behind a
pull-through mirror reaches one: containerd through `hosts.toml` mirrors (`write_mirrors`), which trust the CA per host;
helm through the names resolving to the registry's address (`hosts_mapped`: a hosts file bound over /etc/hosts in a
mount namespace of the command's own) and `--ca-file`. Nothing of the machine's own configuration changes.
A DEV AND TEST FIXTURE.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import random
import secrets
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kai_isolator.shared.pki import CertificateAuthority

from .realnode import RealNode
from .realnode import _tail as log_tail  # the node's daemons' helpers serve this one as well

PORT = 443  # what an `oci://docker.io/...` reference implies: the names resolve to the registry, the port cannot change
# The registries image and chart names are written against, and the host each one's API really answers on (docker.io's
# is registry-1.docker.io, which helm's ORAS dials for docker.io). One flat namespace serves them all.
MIRRORED = {"docker.io": "registry-1.docker.io", "ghcr.io": "ghcr.io", "nvcr.io": "nvcr.io"}
START_TIMEOUT_S = 30.0


class RegistryError(RuntimeError):
    """The registry could not start: its binary, its address (port 443 taken there), its TLS, its storage."""


def pick_loopback_address() -> str:
    """A loopback address of its own for a registry on this machine (all of 127/8 is the loopback's), so port 443 on it is
    free whatever else listens on 127.0.0.1."""
    for _ in range(100):
        candidate = str(ipaddress.ip_address(f"127.{random.randrange(1, 255)}.{random.randrange(256)}.{random.randrange(1, 255)}"))
        with socket.socket() as probe:
            try:
                probe.bind((candidate, PORT))
            except OSError:
                continue
            return candidate
    raise RegistryError(f"no loopback address with port {PORT} free after 100 tries")


@dataclass(frozen=True)
class RegistryPaths:
    """The files of one registry run: its work dir (config, CA, serving pair, log) and its storage."""

    workdir: Path
    storage: Path

    @property
    def ca_file(self) -> Path:
        return self.workdir / "ca.crt"

    @property
    def config(self) -> Path:
        return self.workdir / "config.yml"

    @property
    def log(self) -> Path:
        return self.workdir / "registry.log"


class OciRegistry:
    """`start()` issues the TLS pair, writes the config and runs `registry serve` until it answers `/v2/`; `stop()` ends it."""

    def __init__(self, binary: Path, workdir: Path, *, address: str, storage: Path | None = None) -> None:
        self.binary = binary
        self.address = address
        self.paths = RegistryPaths(Path(workdir), Path(storage) if storage else Path(workdir) / "storage")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """`address:443`, as clients that are told the registry's address (not a name it stands in for) write it."""
        return f"{self.address}:{PORT}"

    @property
    def url(self) -> str:
        return f"https://{self.host}"

    @property
    def ca_file(self) -> Path:
        return self.paths.ca_file

    def ssl_context(self) -> ssl.SSLContext:
        """Trusts this registry's CA only."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _write_tls(self) -> tuple[Path, Path]:
        ca = CertificateAuthority("kai-isolator local registry CA")
        self.ca_file.write_bytes(ca.cert_pem)
        # Its own address, and the registries it stands in for: clients that resolve those names to it verify it as them.
        names = [self.address, *dict.fromkeys([*MIRRORED, *MIRRORED.values()])]
        return ca.issue_server(names).write(self.paths.workdir / "tls.crt", self.paths.workdir / "tls.key")

    def config_text(self, cert: Path, key: Path) -> str:
        # Quiet but for problems; a random HTTP secret of its own (one instance); no redirects (the filesystem driver
        # serves blobs itself); nothing but its storage folder is written.
        return "\n".join([
            "version: 0.1",
            "log:", "  level: warn", "  accesslog:", "    disabled: true",
            "storage:", "  filesystem:", f"    rootdirectory: {self.paths.storage}", "  cache:", "    blobdescriptor: inmemory",
            "  redirect:", "    disable: true",
            "http:", f"  addr: {self.host}", f"  secret: {secrets.token_hex(16)}",
            "  tls:", f"    certificate: {cert}", f"    key: {key}",
        ]) + "\n"

    def start(self) -> OciRegistry:
        self.paths.workdir.mkdir(parents=True, exist_ok=True)
        self.paths.storage.mkdir(parents=True, exist_ok=True)
        cert, key = self._write_tls()
        self.paths.config.write_text(self.config_text(cert, key))
        log = open(self.paths.log, "ab")
        try:
            # OTEL_TRACES_EXPORTER=none: Distribution traces every request and would otherwise export to an OTLP collector.
            self._process = subprocess.Popen([str(self.binary), "serve", str(self.paths.config)], stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self._process.poll() is not None:
                raise RegistryError(f"registry exited {self._process.returncode} while starting on {self.host}:\n{log_tail(self.paths.log)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RegistryError(f"registry did not answer on {self.url} in {START_TIMEOUT_S:.0f}s:\n{log_tail(self.paths.log)}")
            time.sleep(0.1)
        return self

    def _answers(self) -> bool:
        """`GET /v2/` is 200 over TLS verified against the CA: the API version check every client makes first."""
        connection = http.client.HTTPSConnection(self.address, PORT, context=self.ssl_context(), timeout=5)
        try:
            connection.request("GET", "/v2/")
            return connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()

    def stop(self) -> None:
        process, self._process = self._process, None
        RealNode.terminate(process)

    def __enter__(self) -> OciRegistry:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # --- clients ---------------------------------------------------------------------------------------------------

    def write_mirrors(self, config_path: Path) -> Path:
        """containerd's registry host configuration (its `config_path`): each mirrored registry's pulls go to this one,
        trusted by its CA, before the registry itself (unreachable here, as behind an air gap)."""
        for registry, api_host in MIRRORED.items():
            folder = config_path / registry
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts.toml").write_text("\n".join([
                f'server = "https://{api_host}"', "",
                f'[host."{self.url}"]', '  capabilities = ["pull", "resolve"]', f'  ca = "{self.ca_file}"',
            ]) + "\n")
        return config_path

    def hosts_file(self, path: Path, machine_hosts: Path = Path("/etc/hosts")) -> Path:
        """The mirrored registries' names at this registry's address, then this machine's hosts file (the first line
        that names a host wins, so ours come first)."""
        own = machine_hosts.read_text() if machine_hosts.is_file() else "127.0.0.1 localhost\n"
        names = " ".join(dict.fromkeys([*MIRRORED.values(), *MIRRORED]))
        path.write_text(f"# kai-isolator: the local registry stands in for these\n{self.address} {names}\n{own}")
        return path

    def hosts_mapped(self, argv: list[str], hosts: Path) -> list[str]:
        """`argv` run in a mount namespace of its own where `hosts` (see hosts_file) is /etc/hosts: the registries' names
        resolve to this registry for that command alone (root, as the real node needs)."""
        script = 'mount --bind "$0" /etc/hosts && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(hosts), *argv]

    def describe(self) -> str:
        return f"{self.url} (CA {self.ca_file}, storage {self.paths.storage})"

