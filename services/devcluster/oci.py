"""Local OCI image archives for the real node (no registry is reachable): a rootfs of chosen files, one layer.

`image_archive(name, files, path)` writes an OCI image layout tar that `ctr images import` takes; `with_libraries`
adds the shared libraries a dynamically linked program needs, so host programs can be packed as an image;
`docker_archive(tag, cache)` exports an image of the Docker engine (`make images`) once per image id, for the node.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"


class ImageError(RuntimeError):
    """An image could not be made: a missing file, or a program whose libraries cannot be resolved."""


def with_libraries(files: Mapping[str, Path], provided: tuple[str, ...] = ()) -> dict[str, Path]:
    """`files` (image path -> host file) plus every shared library and loader `ldd` names for them, at their host paths;
    `provided`: libraries the runtime adds to the container (the driver's), left out."""
    found = dict(files)
    for source in files.values():
        done = subprocess.run(["ldd", str(source)], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            continue  # static, or not a program: nothing to add
        for line in done.stdout.splitlines():
            if line.split()[0] in provided:
                continue
            if "not found" in line:
                raise ImageError(f"{source}: {line.strip()}")
            match = re.search(r"(/\S+) \(0x", line)
            if match:
                library = Path(match.group(1))
                found.setdefault(str(library), library.resolve())
    return found


def _layer(files: Mapping[str, Path], env_dirs: tuple[str, ...]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        made: set[str] = set()

        def directory(path: PurePosixPath) -> None:
            for parent in reversed((path, *path.parents)):
                name = str(parent).lstrip("/")
                if name and name not in made:
                    made.add(name)
                    info = tarfile.TarInfo(name)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)

        for folder in env_dirs:
            directory(PurePosixPath(folder))
        for target, source in sorted(files.items()):
            if not source.is_file():
                raise ImageError(f"{source}: not a file (wanted at {target} in the image)")
            inside = PurePosixPath(target)
            directory(inside.parent)
            info = tarfile.TarInfo(str(inside).lstrip("/"))
            data = source.read_bytes()
            info.size, info.mode = len(data), source.stat().st_mode & 0o755 | 0o444
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest.split(':')[1]}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return digest


def image_archive(name: str, files: Mapping[str, Path], path: Path, *, entrypoint: list[str] | None = None,
                  command: list[str] | None = None, env: Mapping[str, str] | None = None) -> Path:
    """An OCI image layout tar at `path` holding one image, `name` (a full reference: docker.io/library/x:tag)."""
    layer = _layer(files, ("/tmp", "/proc", "/sys", "/dev", "/etc"))
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "Cmd": command, "Env": [f"{k}={v}" for k, v in (env or {}).items()]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with tarfile.open(partial, "w") as tar:
        layer_digest = _blob(tar, layer)
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = _blob(tar, config_bytes)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": LAYER_TYPE, "digest": layer_digest, "size": len(layer)}],
        }, sort_keys=True).encode()
        manifest_digest = _blob(tar, manifest)
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": MANIFEST_TYPE, "digest": manifest_digest, "size": len(manifest),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}}]}).encode()
        for member, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    partial.replace(path)
    return path


def docker_archive(tag: str, cache: Path, env: Mapping[str, str]) -> Path:
    """`docker save` of `tag` from the engine `env` names, kept in `cache` by image id: a rebuilt image is saved again,
    an unchanged one never twice."""
    done = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], env=dict(env), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ImageError(f"no image {tag} in the Docker engine (run `make images`): {done.stderr.strip()}")
    image_id = done.stdout.strip().removeprefix("sha256:")[:16]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)
    archive = cache / f"{stem}-{image_id}.tar"
    if not archive.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = archive.with_name(f".{archive.name}-{os.getpid()}")
        saved = subprocess.run(["docker", "save", "-o", str(partial), tag], env=dict(env), capture_output=True, text=True, timeout=600)
        if saved.returncode != 0:
            partial.unlink(missing_ok=True)
            raise ImageError(f"docker save {tag} exited {saved.returncode}: {saved.stderr.strip()}")
        partial.replace(archive)
        for stale in cache.glob(f"{stem}-*.tar"):  # the tag's earlier builds
            if stale != archive:
                stale.unlink(missing_ok=True)
    return archive
