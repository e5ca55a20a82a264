"""`make release`: the project as users receive it, published to a real OCI registry on this machine.

Builds the chart's images, pushes them, packages the chart as `<version>-chart` with those images pinned by digest,
checks it (`helm lint --strict`, and a render that names every image by its digest), `helm push`es it beside the images,
and prints each image's digest and size. Images and chart share one repository, as upstream publishes them
(`oci://docker.io/projecthami/kai-resource-isolator`): the services image is tagged `<version>`, the node agent's
`<version>-nodeagent`, the chart `<version>-chart`. Here docker.io is the local registry (oci_registry.py): helm reaches
it under that name, and a node's containerd through its mirrors.

`python -m kai_isolator.services.devcluster.release [--storage DIR]`; the registry runs for the command alone, its
storage (default `~/.cache/kai-isolator/registry`) keeps what was published.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from . import build, images
from .oci import ImageError as ArchiveError
from .oci import docker_archive
from .oci_push import PushedImage, PushError, RegistryClient, push_archive
from .oci_registry import PORT, OciRegistry, RegistryError, pick_loopback_address

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kai-resource-isolator"
REPOSITORY = "docker.io/projecthami/kai-resource-isolator"
CHART_SUFFIX = "-chart"
HELM_TIMEOUT_S = 300


class ReleaseError(RuntimeError):
    """A release step failed: a chart that does not lint, a push the registry refused, a packaged chart that does not
    name the images just pushed."""


@dataclass(frozen=True)
class ReleaseImage:
    """One image of the release: what builds it, its tag's suffix after the version, where the chart's values name it."""

    source: images.ProjectImage
    suffix: str
    values: str  # the values key of its image block, dotted

    def reference(self, version: str) -> str:
        return f"{REPOSITORY}:{version}{self.suffix}"


SERVICES_IMAGE = ReleaseImage(images.SERVICES_IMAGE, "", "image")
NODEAGENT_IMAGE = ReleaseImage(images.NODEAGENT_IMAGE, "-nodeagent", "nodeAgent.image")
RELEASE_IMAGES = (SERVICES_IMAGE, NODEAGENT_IMAGE)


@dataclass(frozen=True)
class Release:
    """What a release published: its images (by values key) and the chart's reference, version and digest."""

    version: str
    images: dict[str, PushedImage]
    chart: str
    chart_version: str
    chart_digest: str


def chart_field(chart: Path, field: str) -> str:
    found = re.search(rf"^{field}:\s*\"?([^\"\s]+)\"?\s*$", (chart / "Chart.yaml").read_text(), re.M)
    if found is None:
        raise ReleaseError(f"{chart / 'Chart.yaml'} has no {field}")
    return found.group(1)


def layer_cache() -> Path:
    """Compressed layers by uncompressed digest, beside the build cache: a layer Docker kept is compressed once."""
    return build.cache_root().parent / "oci-layers"


def registry_client(registry: OciRegistry) -> RegistryClient:
    return RegistryClient(registry.address, PORT, registry.ssl_context())


def push_docker_image(registry: OciRegistry, tag: str, reference: str) -> PushedImage:
    """An image of the Docker engine pushed as `reference` (exported once per image id, compressed once per layer)."""
    archive = docker_archive(tag, build.cache_root().parent / "node-images", images.docker_env())
    return push_archive(registry_client(registry), archive, reference, layer_cache())


class Helm:
    """helm with homes of its own under `workdir`, the registry's names mapped to it, and its CA trusted."""

    def __init__(self, binary: Path, workdir: Path, registry: OciRegistry, kubeconfig: Path | None = None) -> None:
        self.binary, self.workdir, self.registry = binary, Path(workdir), registry
        self.kubeconfig = kubeconfig
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts = registry.hosts_file(self.workdir / "hosts")

    def env(self) -> dict[str, str]:
        env = {**os.environ, "HELM_CACHE_HOME": str(self.workdir / "cache"), "HELM_CONFIG_HOME": str(self.workdir / "config"),
               "HELM_DATA_HOME": str(self.workdir / "data")}
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def argv(self, *args: str) -> list[str]:
        return self.registry.hosts_mapped([str(self.binary), *args], self.hosts)

    def run(self, *args: str, timeout_s: float = HELM_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), env=self.env(), capture_output=True, text=True, timeout=timeout_s)

    def __call__(self, *args: str, timeout_s: float = HELM_TIMEOUT_S) -> str:
        """helm's output (stdout, then stderr, where helm push writes its digest); a failure raises with both."""
        done = self.run(*args, timeout_s=timeout_s)
        if done.returncode != 0:
            raise ReleaseError(f"helm {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done.stdout + done.stderr

    @property
    def registry_flags(self) -> list[str]:
        return ["--ca-file", str(self.registry.ca_file)]


def pin_digests(values: str, digests: dict[str, str]) -> str:
    """values.yaml with `digest: ""` of each image block set, its comments and layout kept (the comments document every
    value; a YAML round trip would drop them). Keys are dotted paths to the image blocks."""
    lines = values.splitlines(keepends=True)
    for key, digest in digests.items():
        start, indent = 0, 0
        for part in (*key.split("."), "digest"):
            start = _key_line(lines, part, indent, start, key)
            indent += 2
        lines[start] = re.sub(r'digest: ""', f"digest: {digest}", lines[start], count=1)
        if digest not in lines[start]:
            raise ReleaseError(f"values {key}.digest is not the empty string of a fresh chart: {lines[start].strip()}")
    return "".join(lines)


def _key_line(lines: list[str], key: str, indent: int, start: int, path: str) -> int:
    """The line of `key:` at `indent` from `start`, within the block that began there (it ends where the indent drops)."""
    for number in range(start, len(lines)):
        line = lines[number]
        if number > start and line.strip() and not line.lstrip().startswith("#") and len(line) - len(line.lstrip()) < indent:
            break
        if re.match(rf"^ {{{indent}}}{re.escape(key)}:(\s|$)", line):
            return number
    raise ReleaseError(f"values.yaml has no {path} ({key}: at indent {indent})")


def stage_chart(chart: Path, into: Path, digests: dict[str, str]) -> Path:
    """A copy of the chart whose values pin the images just pushed."""
    staged = into / chart.name
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(chart, staged)
    values = staged / "values.yaml"
    values.write_text(pin_digests(values.read_text(), digests))
    return staged


def check_packaged(helm: Helm, package: Path, pushed: dict[str, PushedImage]) -> None:
    """The packaged chart renders every image of the release by the digest just pushed, and nothing else of ours."""
    rendered = helm("template", "kai-resource-isolator", str(package), "--namespace", "kai-resource-isolator")
    named = set(re.findall(r"image: (\S*projecthami/kai-resource-isolator\S*)", rendered))
    expected = {image.pinned for image in pushed.values()}
    if named != expected:
        raise ReleaseError(f"the packaged chart names {sorted(named)}, the release pushed {sorted(expected)}")


def publish(registry: OciRegistry, helm: Helm, workdir: Path, log: TextIO = sys.stderr, *, chart: Path = CHART) -> Release:
    """Push the built images, then package, check and push the chart pinning them. The images must be in the engine
    (`build_images`)."""
    version = chart_field(chart, "version")
    app_version = chart_field(chart, "appVersion")
    pushed: dict[str, PushedImage] = {}
    for image in RELEASE_IMAGES:
        started = time.monotonic()
        pushed[image.values] = push_docker_image(registry, image.source.tag, image.reference(app_version))
        print(f"pushed {pushed[image.values].pinned} in {time.monotonic() - started:.1f}s", file=log, flush=True)
    staged = stage_chart(chart, workdir / "staged", {key: image.digest for key, image in pushed.items()})
    helm("lint", "--strict", str(staged))
    chart_version = f"{version}{CHART_SUFFIX}"
    out = helm("package", str(staged), "--version", chart_version, "--app-version", app_version, "--destination", str(workdir))
    package = workdir / f"{chart.name}-{chart_version}.tgz"
    if not package.is_file():
        raise ReleaseError(f"helm package left no {package}:\n{out}")
    check_packaged(helm, package, pushed)
    repository_base = f"oci://{REPOSITORY.rsplit('/', 1)[0]}"
    out = helm("push", str(package), repository_base, *helm.registry_flags)
    digest = re.search(r"Digest: (sha256:[0-9a-f]{64})", out)
    if digest is None:
        raise ReleaseError(f"helm push printed no digest:\n{out}")
    return Release(app_version, pushed, f"oci://{REPOSITORY}", chart_version, digest.group(1))


def build_images(log: TextIO = sys.stderr) -> None:
    """The release's images from this tree (Docker's layer cache makes an unchanged tree cost seconds)."""
    kube_builder = images.ensure_prerequisites(log)
    for image in RELEASE_IMAGES:
        images.build_image(image.source, kube_builder, log)


def report(release: Release) -> str:
    width = max(len(image.reference) for image in release.images.values())
    rows = [f"{'image':<{width}} {'digest':<71} {'pull':>8} {'unpacked':>9} layers"]
    for image in release.images.values():
        rows.append(f"{image.reference:<{width}} {image.digest:<71} {image.pull_bytes / 1e6:>6.1f}MB {image.unpacked_bytes / 1e6:>7.1f}MB "
                    f"{image.layers:>6}")
    rows.append(f"chart {release.chart} --version {release.chart_version}: {release.chart_digest}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kai_isolator.services.devcluster.release", description=__doc__.splitlines()[0])
    parser.add_argument("--storage", type=Path, default=build.cache_root().parent / "registry",
                        help="the registry's storage folder (kept: what was published)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        helm_binary, registry_binary = build.release_tools()
        build_images()
        with tempfile.TemporaryDirectory(prefix="kai-isolator-release-") as scratch:
            workdir = Path(scratch)
            with OciRegistry(registry_binary, workdir / "registry", address=pick_loopback_address(), storage=args.storage) as registry:
                print(f"registry: {registry.describe()}", file=sys.stderr, flush=True)
                release = publish(registry, Helm(helm_binary, workdir / "helm", registry), workdir)
    except (ReleaseError, RegistryError, PushError, ArchiveError, images.ImageError, build.BuildError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(report(release))
    print(f"released {release.version} in {time.monotonic() - started:.0f}s into {args.storage}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
