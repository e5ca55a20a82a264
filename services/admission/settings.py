"""The webhook's settings: where it listens, its TLS pair, what it injects and how strict its policy is."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kai_isolator.shared.contract import DEFAULT_GRANT_DIR, DEFAULT_STATE_DIR, DEFAULT_VGPU_MOUNT
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.settings import ENV_PREFIX, split_host_port

PolicyMode = Literal["enforce", "warn", "off"]

MAX_BODY_BYTES = 3 * 1024 * 1024
"""AdmissionReviews larger than this are refused with a 400 (a Pod is far smaller)."""


def clean_absolute_path(value: str) -> str:
    """An absolute, normalised path that is not the root (a hostPath of / would expose the node)."""
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path, got {value!r}")
    cleaned = posixpath.normpath(value)
    if cleaned.startswith("//"):
        cleaned = "/" + cleaned.lstrip("/")
    if cleaned == "/":
        raise ValueError("must not be /")
    return cleaned


class AdmissionSettings(BaseSettings):
    """Every flag of `kai-isolator admission`, each also read from `KAI_ISOLATOR_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    listen: str = Field("0.0.0.0:8443", description="HOST:PORT of the HTTPS endpoint")
    tls_cert_file: Path = Field(Path("/etc/tls/tls.crt"), description="PEM serving certificate (chain)")
    tls_private_key_file: Path = Field(Path("/etc/tls/tls.key"), description="PEM private key of the certificate")
    container_vgpu_mount: str = Field(DEFAULT_VGPU_MOUNT, description="node directory holding libvgpu.so and ld.so.preload; mounted at the same path")
    state_dir: str = Field(DEFAULT_STATE_DIR, description="node directory of per-container state directories")
    grant_dir: str = Field(DEFAULT_GRANT_DIR, description="node directory of per-container grants the node agent writes; mounted read-only")
    policy: PolicyMode = Field("warn", description="tenant-escape policy: enforce (deny), warn (allow with warnings) or off")
    allow_pod_opt_out: bool = Field(True, description="honour the pod annotation kai-resource-isolator.io/inject: \"false\"")
    tls_reload_interval_s: float = Field(2.0, gt=0, description="how often the certificate files are checked for a new pair")
    event_queue_size: int = Field(10_000, ge=1, description="decisions waiting for the bus; beyond this they are dropped and counted")
    publish_concurrency: int = Field(256, ge=1, le=4096, description="decisions sent to the bus and not yet acknowledged, at most")
    require_nri_plugin: str = Field("", pattern=r"^[a-z0-9-]*$",
                                    description="the node agent's NRI plugin every container of a GPU-sharing pod requires (NRI's "
                                                "required-plugins annotation, which containerd's default validator enforces): such a "
                                                "container is not created on a node where the plugin is not registered; empty = none")

    @field_validator("container_vgpu_mount", "state_dir", "grant_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return clean_absolute_path(value)

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        try:
            split_host_port(value)
        except ConfigError as error:
            raise ValueError(str(error)) from None
        return value

    @model_validator(mode="after")
    def _apart(self) -> AdmissionSettings:
        lib, state, grant = self.container_vgpu_mount, self.state_dir, self.grant_dir
        if is_within(state, lib) or is_within(lib, state):
            raise ValueError(f"state_dir {state} and container_vgpu_mount {lib} must not contain each other: the library directory is read-only")
        for name, other in (("state_dir", state), ("container_vgpu_mount", lib)):
            if is_within(grant, other) or is_within(other, grant):
                raise ValueError(f"grant_dir {grant} and {name} {other} must not contain each other: grants are the node agent's alone")
        return self


def is_within(path: str, directory: str) -> bool:
    """`path` is `directory` or below it (both normalised)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")
