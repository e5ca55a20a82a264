"""Builds every container image of the project where no registry is reachable: stand-ins for the public base images
made from Debian packages, the project's images from their Dockerfiles, and Docker Compose as a CLI plugin.

`python -m kai_isolator.services.devcluster.images` (`make images`) builds what is missing and prints each phase's
time and each image's size. Base images and Go programs are cached by digest, the rest by Docker's layer cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kai_isolator.services.devcluster import build

REPO = Path(__file__).resolve().parents[2]
BUILD_CA = REPO / "deploy" / "docker" / "build-ca.pem"  # gitignored; the Dockerfiles' build stages look for it
DIGEST_LABEL = "io.kai-isolator.stand-in-digest"
BUILD_TIMEOUT_S = 1800

NATS_SERVER = build.Component("nats-server", build.MODULES / "nats", "github.com/nats-io/nats-server/v2",
                              ("github.com/nats-io/nats-server/v2",))
COMPOSE = build.Component("docker-compose", build.MODULES / "compose", "github.com/docker/compose/v2",
                          ("github.com/docker/compose/v2/cmd",))


class ImageError(RuntimeError):
    """An image could not be built: no Docker engine, no mmdebstrap, a failing build."""


def engine_state() -> Path:
    """Where `hack/dockerd` keeps its engine (data root, socket, log); also the compose plugin's DOCKER_CONFIG."""
    explicit = os.environ.get("KAI_ISOLATOR_DOCKER_STATE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kai-isolator" / "docker"


def docker_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment docker commands run in: the engine DOCKER_HOST names, else the system's, else `hack/dockerd`'s."""
    env = dict(os.environ if base is None else base)
    private = engine_state() / "docker.sock"
    if "DOCKER_HOST" not in env and not Path("/var/run/docker.sock").exists() and private.exists():
        env["DOCKER_HOST"] = f"unix://{private}"
    env["DOCKER_BUILDKIT"] = "0"  # BuildKit would pull its frontend from a registry, and no buildx plugin is assumed
    return env


def compose_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """docker_env plus the DOCKER_CONFIG whose cli-plugins folder holds the compose plugin `ensure_compose` built."""
    return {**docker_env(base), "DOCKER_CONFIG": str(engine_state() / "config")}


def _docker(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *args], env=env or docker_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ImageError(f"docker {' '.join(args[:3])} ... exited {done.returncode}: {(done.stderr or done.stdout).strip()[-3000:]}")
    return done.stdout


def engine_answers(env: dict[str, str] | None = None) -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        done = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], env=env or docker_env(),
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def _require_engine() -> None:
    if not engine_answers():
        where = docker_env().get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise ImageError(f"no Docker engine answers at {where}: start one (`hack/dockerd` starts a private one) "
                         "or set DOCKER_HOST")


def _label(tag: str) -> str | None:
    """The stand-in digest label of a local image; None when there is no image of that name."""
    done = subprocess.run(["docker", "image", "inspect", "--format", f'{{{{index .Config.Labels "{DIGEST_LABEL}"}}}}', tag],
                          env=docker_env(), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return None
    label = done.stdout.strip()
    return "" if label == "<no value>" else label


def _size_mb(tag: str) -> float:
    return int(_docker("image", "inspect", "--format", "{{.Size}}", tag).strip()) / 1e6


def _content_digest(path: Path) -> str:
    """A file's bytes; for a folder (a Go toolchain), every file's relative path and size."""
    sha = hashlib.sha256()
    if path.is_file():
        sha.update(path.read_bytes())
    else:
        for found in sorted(p for p in path.rglob("*") if p.is_file()):
            sha.update(f"{found.relative_to(path)}\0{found.stat().st_size}\n".encode())
    return sha.hexdigest()


def _go_root() -> Path:
    done = subprocess.run([build._go(), "env", "GOROOT"], capture_output=True, text=True, timeout=60, check=True)
    return Path(done.stdout.strip())


def _cuda_header() -> Path:
    header = Path(os.environ.get("CUDA_HOME", REPO / ".cuda-headers" / "nvidia" / "cu13")) / "include" / "cuda.h"
    if not header.is_file():
        raise ImageError(f"no {header}: run `make hami-core` first (it fetches the driver API header)")
    return header


def _nats_server() -> Path:
    return build.ensure(NATS_SERVER) / "nats-server"


@dataclass(frozen=True)
class BaseImage:
    """A local stand-in for a public base image: a Debian root filesystem plus a few files from this machine."""

    tag: str  # the public name the Dockerfiles and docker-compose.yml use
    suite: str
    packages: tuple[str, ...]
    files: tuple[tuple[Callable[[], Path], str], ...] = ()  # (where on this machine, path in the image)
    changes: tuple[str, ...] = ()  # Dockerfile instructions `docker import --change` applies

    def sources(self) -> list[tuple[Path, str]]:
        return [(find(), inside) for find, inside in self.files]

    def digest(self) -> str:
        sha = hashlib.sha256(json.dumps([self.suite, self.packages, self.changes, MMDEBSTRAP_OPTIONS]).encode())
        for source, inside in self.sources():
            sha.update(f"{inside}\0{_content_digest(source)}\n".encode())
        return sha.hexdigest()[:16]


PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Smaller root filesystems, as the slim images are: no manuals, docs or translations.
MMDEBSTRAP_OPTIONS = ("--variant=minbase", "--aptopt=Acquire::Languages \"none\"",
                      "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
                      "--dpkgopt=path-include=/usr/share/doc/*/copyright", "--dpkgopt=path-exclude=/usr/share/locale/*")

PYTHON = BaseImage("python:3.11-slim-bookworm", "bookworm", ("python3", "python3-venv", "python-is-python3", "ca-certificates"),
                   changes=(f"ENV PATH={PATH}", "ENV LANG=C.UTF-8", 'CMD ["python3"]'))
# Debian's Go is too old for the pinned modules, so the stand-in carries this machine's toolchain, where the real image has its own.
GOLANG = BaseImage("golang:1.26-bookworm", "bookworm", ("ca-certificates",), files=((_go_root, "/usr/local/go"),),
                   changes=(f"ENV PATH=/usr/local/go/bin:{PATH}", "ENV GOTOOLCHAIN=local", 'CMD ["bash"]'))
# Bullseye has the glibc (2.31) of the real image's Ubuntu 20.04; libvgpu.so needs only the driver API header from CUDA.
CUDA_DEVEL = BaseImage("nvidia/cuda:12.4.1-devel-ubuntu20.04", "bullseye", ("libc6-dev", "ca-certificates"),
                       files=((_cuda_header, "/usr/local/cuda/include/cuda.h"),),
                       changes=(f"ENV PATH=/usr/local/cuda/bin:{PATH}", "ENV CUDA_HOME=/usr/local/cuda", 'CMD ["bash"]'))
# nats-server built from its pinned module at the tag's version; wget for docker-compose.yml's healthcheck.
NATS = BaseImage("nats:2.10.22-alpine", "bookworm", ("wget",), files=((_nats_server, "/usr/local/bin/nats-server"),),
                 changes=(f"ENV PATH={PATH}", 'ENTRYPOINT ["nats-server"]', "EXPOSE 4222 6222 8222"))
BASE_IMAGES = (PYTHON, GOLANG, CUDA_DEVEL, NATS)


def _mmdebstrap(base: BaseImage, tarball: Path) -> None:
    if shutil.which("mmdebstrap") is None:
        raise ImageError("no mmdebstrap: install Debian's mmdebstrap package (base images are made from Debian packages)")
    hooks = []
    for source, inside in base.sources():
        target = shlex.quote(inside)
        hooks.append(f'--customize-hook=mkdir -p "$1"{shlex.quote(str(Path(inside).parent))} && cp -a {shlex.quote(str(source))} "$1"{target}')
    command = ["mmdebstrap", *MMDEBSTRAP_OPTIONS, f"--include={','.join(base.packages)}", *hooks, base.suite, str(tarball)]
    # A mount namespace with a private /run: mmdebstrap's mounts would otherwise record themselves in /run/mount.
    wrapped = ["unshare", "--mount", "sh", "-c", 'mount -n -t tmpfs -o mode=0755 tmpfs /run && exec "$@"', "sh", *command]
    done = subprocess.run(wrapped, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise ImageError(f"mmdebstrap for {base.tag} exited {done.returncode}:\n{done.stderr.strip()[-3000:]}")


def ensure_base(base: BaseImage, log: TextIO = sys.stderr) -> None:
    """Make the stand-in unless an image of that name is there: ours at this digest, or a real one (never replaced)."""
    digest = base.digest()
    found = _label(base.tag)
    if found == digest:
        print(f"base image {base.tag}: cached ({digest})", file=log, flush=True)
        return
    if found == "":
        print(f"base image {base.tag}: a non-stand-in image of that name is present, kept", file=log, flush=True)
        return
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kai-base-") as scratch:
        tarball = Path(scratch) / "rootfs.tar"
        _mmdebstrap(base, tarball)
        changes = [*base.changes, f"LABEL {DIGEST_LABEL}={digest}"]
        _docker("import", *[arg for change in changes for arg in ("--change", change)], str(tarball), base.tag,
                timeout=BUILD_TIMEOUT_S)
    print(f"base image {base.tag}: made from Debian {base.suite} in {time.monotonic() - started:.0f}s, "
          f"{_size_mb(base.tag):.0f} MB", file=log, flush=True)


def ensure_compose(log: TextIO = sys.stderr) -> Path:
    """The compose CLI plugin, built from its pinned module, linked into compose_env()'s DOCKER_CONFIG."""
    started = time.monotonic()
    binary = build.ensure(COMPOSE, log) / "cmd"
    plugins = engine_state() / "config" / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    link = plugins / "docker-compose"
    if not (link.is_symlink() and link.resolve() == binary.resolve()):
        scratch = plugins / f".docker-compose-{os.getpid()}"
        scratch.unlink(missing_ok=True)
        scratch.symlink_to(binary)
        os.replace(scratch, link)
    print(f"docker compose {COMPOSE.version}: ready in {time.monotonic() - started:.0f}s -> {link}", file=log, flush=True)
    return link


def ensure_kube_builder(log: TextIO = sys.stderr) -> str:
    """A Go builder image whose kube cache already holds `make control-plane`'s binaries, for Dockerfile.devcluster's
    GO_IMAGE: its build.py then finds them by digest instead of building them a second time inside Docker."""
    entries = [build.ensure(component, log) for component in build.COMPONENTS]
    tag = "kai-isolator-kube-builder:" + hashlib.sha256("\0".join(e.name for e in entries).encode()).hexdigest()[:12]
    if _label(tag) is not None:
        return tag
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kai-kube-builder-") as scratch:
        context = Path(scratch)
        for found in entries:
            shutil.copytree(found, context / "kube" / found.name)
            (context / "kube" / found.name).chmod(0o755)  # entries built before build.py made them world-readable
        (context / "Dockerfile").write_text(f"FROM {GOLANG.tag}\nCOPY kube /opt/kube\n")
        _docker("build", "--network", "none", "-q", "-t", tag, str(context), timeout=BUILD_TIMEOUT_S)
    print(f"builder image {tag}: made in {time.monotonic() - started:.0f}s", file=log, flush=True)
    return tag


def build_ca_source() -> Path | None:
    """This machine's CA bundle: the one PIP_CERT or SSL_CERT_FILE names, else OpenSSL's default, else Debian's."""
    candidates = (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), ssl.get_default_verify_paths().cafile,
                  "/etc/ssl/certs/ca-certificates.crt")
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


@contextlib.contextmanager
def build_ca() -> Iterator[None]:
    """This machine's CA bundle where the Dockerfiles' build stages look, while a build runs; gone afterwards.
    Nothing is written where the machine has none."""
    source = build_ca_source()
    if source is None:
        yield
        return
    shutil.copyfile(source, BUILD_CA)
    try:
        yield
    finally:
        BUILD_CA.unlink(missing_ok=True)


@dataclass(frozen=True)
class ProjectImage:
    tag: str  # as docker-compose.yml names it
    dockerfile: str
    target: str = ""  # a build stage; the last one when empty

    def build_args(self, kube_builder: str) -> list[str]:
        args = ["--target", self.target] if self.target else []
        if self.dockerfile.endswith(".devcluster"):
            args += ["--build-arg", f"GO_IMAGE={kube_builder}"]
        return args


# The two images a release publishes (release.py), and docker-compose's local control plane.
SERVICES_IMAGE = ProjectImage("kai-isolator:dev", "deploy/docker/Dockerfile")
NODEAGENT_IMAGE = ProjectImage("kai-isolator-nodeagent:dev", "deploy/docker/Dockerfile.nodeagent")
PROJECT_IMAGES = (SERVICES_IMAGE, NODEAGENT_IMAGE, ProjectImage("kai-isolator-devcluster:dev", "deploy/docker/Dockerfile.devcluster"))
# docker-compose.yml's GPU stand-in (hami-core's fake driver and NVML); a dev image, never deployed.
FAKE_GPU_DRIVER = ProjectImage("fake-gpu-driver:dev", "deploy/docker/Dockerfile.nodeagent", target="fake-driver")


def build_image(image: ProjectImage, kube_builder: str, log: TextIO = sys.stderr) -> float:
    started = time.monotonic()
    with build_ca():
        done = subprocess.run(["docker", "build", "--force-rm", "--network", "host", "-f", image.dockerfile, "-t", image.tag,
                               *image.build_args(kube_builder), "."], cwd=REPO, env=docker_env(), capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise ImageError(f"docker build of {image.tag} ({image.dockerfile}) exited {done.returncode}:\n"
                         f"{(done.stdout + done.stderr).strip()[-4000:]}")
    elapsed = time.monotonic() - started
    print(f"image {image.tag}: built in {elapsed:.0f}s, {_size_mb(image.tag):.0f} MB", file=log, flush=True)
    return elapsed


def ensure_prerequisites(log: TextIO = sys.stderr) -> str:
    """Base images, the kube builder image and the compose plugin; returns the builder image's tag."""
    _require_engine()
    started = time.monotonic()
    for base in BASE_IMAGES:
        ensure_base(base, log)
    print(f"phase base images: {time.monotonic() - started:.0f}s", file=log, flush=True)
    kube_builder = ensure_kube_builder(log)
    ensure_compose(log)
    return kube_builder


def main() -> int:
    started = time.monotonic()
    try:
        kube_builder = ensure_prerequisites()
        for image in (*PROJECT_IMAGES, FAKE_GPU_DRIVER):
            build_image(image, kube_builder)
    except (ImageError, build.BuildError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"images ready in {time.monotonic() - started:.0f}s: " + ", ".join(i.tag for i in (*PROJECT_IMAGES, FAKE_GPU_DRIVER)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
