"""Pushes an image archive (`docker save`'s, or an OCI image layout tar) to an OCI registry through the distribution
API, as `docker push` does: each uncompressed layer gzip-compressed (once per layer, kept in a cache), only the blobs
the registry lacks uploaded, then the manifest under its tag. TLS is verified against the registry's CA.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import json
import os
import shutil
import ssl
import tarfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"  # Docker's image config has the same fields
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
UNCOMPRESSED_LAYERS = {"application/vnd.oci.image.layer.v1.tar", "application/vnd.docker.image.rootfs.diff.tar"}
CHUNK = 1 << 20


class PushError(RuntimeError):
    """An archive that holds no single image, or a registry that refused a blob or the manifest."""


@dataclass(frozen=True)
class PushedImage:
    """One image as the registry now holds it."""

    reference: str  # as users name it: docker.io/<repository>:<tag>
    digest: str  # the manifest's: what a chart pins
    pull_bytes: int  # config and compressed layers: what a node downloads
    unpacked_bytes: int  # the layers as tar streams
    layers: int

    @property
    def pinned(self) -> str:
        """`<reference>@<digest>`: the tag for readers, the digest for the runtime (how the chart names it)."""
        return f"{self.reference}@{self.digest}"

    @property
    def by_digest(self) -> str:
        """`<registry>/<repository>@<digest>`, without the tag (how kustomize pins it, how containerd files a pull)."""
        return f"{self.reference.rsplit(':', 1)[0]}@{self.digest}"


@dataclass(frozen=True)
class Blob:
    """A blob ready to upload: its descriptor and where its bytes are (a file, or in memory)."""

    media_type: str
    digest: str
    size: int
    path: Path | None = None
    data: bytes = b""

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


class RegistryClient:
    """The distribution API's push half, and reading a manifest back; one verified TLS connection per request."""

    def __init__(self, address: str, port: int, context: ssl.SSLContext) -> None:
        self.address, self.port, self.context = address, port, context

    def _request(self, method: str, target: str, body: bytes | IO[bytes] | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPSConnection(self.address, self.port, context=self.context, timeout=300)
        try:
            connection.request(method, target, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def has_blob(self, repository: str, digest: str) -> bool:
        status, _, _ = self._request("HEAD", f"/v2/{repository}/blobs/{digest}")
        return status == 200

    def upload(self, repository: str, blob: Blob) -> None:
        """A monolithic upload: POST opens it, one PUT with the digest sends the bytes and closes it."""
        if self.has_blob(repository, blob.digest):
            return
        status, headers, body = self._request("POST", f"/v2/{repository}/blobs/uploads/", b"", {"Content-Length": "0"})
        if status != 202 or "location" not in headers:
            raise PushError(f"starting an upload to {repository}: HTTP {status} {body[:300]!r}")
        location = urllib.parse.urlsplit(headers["location"])
        query = urllib.parse.urlencode([*urllib.parse.parse_qsl(location.query), ("digest", blob.digest)])
        target = f"{location.path}?{query}"
        put_headers = {"Content-Type": "application/octet-stream", "Content-Length": str(blob.size)}
        if blob.path is not None:
            with open(blob.path, "rb") as stream:
                status, _, body = self._request("PUT", target, stream, put_headers)
        else:
            status, _, body = self._request("PUT", target, blob.data, put_headers)
        if status != 201:
            raise PushError(f"uploading {blob.digest} to {repository}: HTTP {status} {body[:300]!r}")

    def put_manifest(self, repository: str, tag: str, manifest: bytes, media_type: str) -> str:
        status, headers, body = self._request("PUT", f"/v2/{repository}/manifests/{tag}", manifest,
                                              {"Content-Type": media_type, "Content-Length": str(len(manifest))})
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        if status != 201:
            raise PushError(f"putting the manifest of {repository}:{tag}: HTTP {status} {body[:300]!r}")
        if headers.get("docker-content-digest", digest) != digest:
            raise PushError(f"{repository}:{tag}: the registry stored {headers['docker-content-digest']}, we sent {digest}")
        return digest

    def manifest(self, repository: str, reference: str) -> tuple[str, bytes]:
        """A manifest as stored (media type, bytes), by tag or digest."""
        status, headers, body = self._request("GET", f"/v2/{repository}/manifests/{reference}",
                                              headers={"Accept": ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))})
        if status != 200:
            raise PushError(f"no manifest {repository}:{reference}: HTTP {status} {body[:300]!r}")
        return headers.get("content-type", ""), body


@dataclass(frozen=True)
class ArchiveLayer:
    """A layer as an archive holds it: its media type, the digest and size of its bytes, the tar member they are in."""

    media_type: str
    digest: str
    size: int
    member: str


class ImageArchive:
    """The one image of an image archive: an OCI image layout tar, or `docker save`'s (its `manifest.json`, which every
    Docker writes; newer ones write an OCI layout beside it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar = tarfile.open(path)

    def close(self) -> None:
        self._tar.close()

    def read(self, member: str) -> bytes:
        return self.open(member).read()

    def open(self, member: str) -> IO[bytes]:
        try:
            found = self._tar.extractfile(member)
        except KeyError:
            found = None
        if found is None:
            raise PushError(f"{self.path}: no {member}")
        return found

    def image(self) -> tuple[bytes, list[ArchiveLayer]]:
        """The image's config and its layers, in order."""
        names = set(self._tar.getnames())
        if "manifest.json" in names:
            return self._docker_image()
        if "index.json" in names:
            return self._oci_image()
        raise PushError(f"{self.path}: neither `docker save` output (manifest.json) nor an OCI image layout (index.json)")

    def _docker_image(self) -> tuple[bytes, list[ArchiveLayer]]:
        entries = json.loads(self.read("manifest.json"))
        if len(entries) != 1:
            raise PushError(f"{self.path}: expected one image, manifest.json lists {len(entries)}")
        config = self.read(entries[0]["Config"])
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]  # the layers' digests: they are stored uncompressed
        members = entries[0]["Layers"]
        if len(diff_ids) != len(members):
            raise PushError(f"{self.path}: {len(members)} layers, {len(diff_ids)} diff_ids in the config")
        return config, [ArchiveLayer("application/vnd.docker.image.rootfs.diff.tar", digest, self._tar.getmember(member).size, member)
                        for member, digest in zip(members, diff_ids)]

    def _oci_image(self) -> tuple[bytes, list[ArchiveLayer]]:
        index = json.loads(self.read("index.json"))
        while True:  # through nested indexes to the one amd64 image
            entries = [e for e in index.get("manifests", []) if e.get("platform", {}).get("architecture", "amd64") == "amd64"]
            if len(entries) != 1:
                raise PushError(f"{self.path}: expected one amd64 image, an index lists {len(entries)}")
            document = json.loads(self.read(_blob_member(entries[0]["digest"])))
            if document.get("mediaType", entries[0].get("mediaType")) not in (OCI_INDEX, DOCKER_LIST):
                break
            index = document
        config = self.read(_blob_member(document["config"]["digest"]))
        return config, [ArchiveLayer(layer["mediaType"], layer["digest"], layer["size"], _blob_member(layer["digest"]))
                        for layer in document["layers"]]


def _blob_member(digest: str) -> str:
    algorithm, hexdigest = digest.split(":", 1)
    return f"blobs/{algorithm}/{hexdigest}"


def compressed_layer(archive: ImageArchive, layer: ArchiveLayer, cache: Path) -> Blob:
    """An uncompressed layer gzip-compressed into `cache` (named by the uncompressed digest, so a layer Docker's build
    cache kept is compressed once), or a compressed one as it is."""
    if layer.media_type not in UNCOMPRESSED_LAYERS:
        return Blob(layer.media_type, layer.digest, layer.size, data=archive.read(layer.member))
    hexdigest = layer.digest.split(":", 1)[1]
    target = cache / f"{hexdigest}.tar.gz"
    digest_file = target.with_suffix(".digest")
    if target.is_file() and digest_file.is_file():
        os.utime(target)  # in use: see prune_layer_cache
    else:
        prune_layer_cache(cache)
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}-{os.getpid()}")
        sha = hashlib.sha256()
        with open(partial, "wb") as out:
            hashing = _HashingWriter(out, sha)
            # mtime 0 and no file name: the same layer always compresses to the same bytes, hence the same digest.
            with gzip.GzipFile(filename="", mode="wb", fileobj=hashing, mtime=0) as compressing:  # type: ignore[arg-type]
                shutil.copyfileobj(archive.open(layer.member), compressing, CHUNK)
        digest_file.write_text(f"sha256:{sha.hexdigest()}\n")
        partial.replace(target)
    return Blob(GZIP_LAYER, digest_file.read_text().strip(), target.stat().st_size, path=target)


LAYER_CACHE_DAYS = 7
"""A compressed layer no push used for this long goes: each image rebuild leaves the layers it replaced behind."""


def prune_layer_cache(cache: Path, days: float = LAYER_CACHE_DAYS) -> None:
    if not cache.is_dir():
        return
    horizon = time.time() - days * 86400
    for layer in cache.glob("*.tar.gz"):
        with contextlib.suppress(FileNotFoundError):  # a concurrent push pruned it first
            if layer.stat().st_mtime < horizon:
                layer.with_suffix(".digest").unlink(missing_ok=True)
                layer.unlink()


class _HashingWriter:
    """A file that hashes what is written through it."""

    def __init__(self, out: IO[bytes], sha: Any) -> None:
        self.out, self.sha = out, sha

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()


def push_archive(client: RegistryClient, archive_path: Path, reference: str, cache: Path) -> PushedImage:
    """The archive's image pushed as `reference` (`docker.io/<repository>:<tag>`; the registry part only names it)."""
    repository, tag = split_reference(reference)
    archive = ImageArchive(archive_path)
    try:
        config_bytes, archived = archive.image()
        layers = [compressed_layer(archive, layer, cache) for layer in archived]
        config = Blob(OCI_CONFIG, "sha256:" + hashlib.sha256(config_bytes).hexdigest(), len(config_bytes), data=config_bytes)
        for blob in (*layers, config):
            client.upload(repository, blob)
        pushed = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config.descriptor(), "layers": [b.descriptor() for b in layers]}
        data = json.dumps(pushed, separators=(",", ":")).encode()
        digest = client.put_manifest(repository, tag, data, OCI_MANIFEST)
        unpacked = sum(layer.size for layer in archived if layer.media_type in UNCOMPRESSED_LAYERS)
    finally:
        archive.close()
    return PushedImage(reference, digest, config.size + sum(b.size for b in layers), unpacked, len(layers))


def split_reference(reference: str) -> tuple[str, str]:
    """`docker.io/projecthami/x:1.0` -> (`projecthami/x`, `1.0`); a one-part docker.io name gains `library/`."""
    name, _, tag = reference.rpartition(":")
    if not name or "/" in tag:
        raise PushError(f"{reference}: expected <registry>/<repository>:<tag>")
    registry, _, repository = name.partition("/")
    if "." not in registry and ":" not in registry and registry != "localhost":
        registry, repository = "docker.io", name  # no registry part: Docker Hub, as every client reads it
    if registry == "docker.io" and "/" not in repository:
        repository = f"library/{repository}"
    return repository, tag
