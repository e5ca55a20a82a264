"""Settings of the pod watcher, from `KAI_ISOLATOR_WATCHER_*` env vars and flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kai_isolator.shared import subjects


class WatcherSettings(BaseSettings):
    """Where the Kubernetes API is, what to watch, and how patient to be with it."""

    model_config = SettingsConfigDict(env_prefix="KAI_ISOLATOR_WATCHER_", extra="ignore", frozen=True)

    kubeconfig: Path | None = Field(None, description="kubeconfig file; unset = in-cluster service account, then ~/.kube/config")
    node: str | None = Field(None, description="watch only pods bound to this node (spec.nodeName)")
    watch_timeout_s: int = Field(300, ge=1, description="server-side timeoutSeconds of each watch request")
    read_timeout_s: float = Field(90.0, gt=0, description="a watch silent this long (no event, no bookmark) is treated as dead")
    connect_timeout_s: float = Field(10.0, gt=0, description="connecting to the API server gives up after this long")
    list_timeout_s: float = Field(60.0, gt=0, description="limit of one list (relist) request")
    resume_save_every: int = Field(200, ge=1, description="save the resume version after this many changes")
    resume_save_interval_s: float = Field(2.0, gt=0, description="... or after this long, whichever comes first")
    backoff_base_s: float = Field(0.2, gt=0, description="first retry delay after an API or bus failure; doubles")
    backoff_max_s: float = Field(10.0, gt=0, description="cap of that retry delay")
    resume_bucket: str = Field("isolator-watch-resume", pattern=r"^[A-Za-z0-9_-]+$", description="KV bucket of the saved resume versions")
    state_bucket: str = Field("isolator-pod-state", pattern=r"^[A-Za-z0-9_-]+$", description="KV bucket of the per-pod records")
    lanes: int = Field(64, ge=1, le=1024, description="pods handled side by side; one pod's changes always in order on one lane")
    max_in_flight: int = Field(2048, ge=1, description="changes read but not yet fully handled; the watch is not read beyond this")
    lease_ttl_s: float = Field(10.0, ge=0.5, le=300, description="active/standby: a standby takes over after the leader's lease went unrenewed this long")

    @model_validator(mode="after")
    def _read_outlives_server_timeout(self) -> WatcherSettings:
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError("backoff_max_s must be at least backoff_base_s")
        return self

    @property
    def scope(self) -> str:
        """KV key prefix: one resume point and one set of pod records per watched scope."""
        # Encoded like a subject token: node `gpu` must not read the records of node `gpu.a`.
        return f"node.{subjects.encode_token(self.node)}" if self.node else "all"
