"""Verifier settings, from `KAI_ISOLATOR_VERIFIER_*` env vars and flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kai_isolator.shared.contract import DEFAULT_VGPU_MOUNT

OnMissing = Literal["warn", "annotate", "evict"]


class VerifierSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KAI_ISOLATOR_VERIFIER_", extra="ignore", frozen=True)

    reverify_s: float = Field(300.0, gt=0, description="re-inspect every running GPU-sharing pod this often")
    pending_retry_s: float = Field(10.0, gt=0, description="retry pods that could not be inspected yet this often")
    on_missing: OnMissing = Field("warn", description="warn: Warning Event; annotate: also mark the pod; evict: also evict it")
    kubeconfig: Path | None = Field(None, description="kubeconfig for Kubernetes Events; unset = in-cluster")
    kubernetes_events: bool = Field(True, description="post Kubernetes Events on pods")
    container_vgpu_mount: str = Field(DEFAULT_VGPU_MOUNT, description="where the library is mounted in containers")
    inspect_timeout_s: float = Field(5.0, gt=0, description="wait this long for the node agent's inspect reply")
    unobservable_inspections: int = Field(3, ge=1, description="a Running container with no process in this many inspections ...")
    unobservable_after_s: float = Field(30.0, ge=0, description="... spanning at least this long is `degraded: unobservable`")
    confirm_negative_after_s: float = Field(2.0, ge=0, description="a missing or degraded verdict from one look inside a container "
                                            "is issued only when a second look this much later sees the same")
    pod_condition: bool = Field(True, description="write the pod condition kai-resource-isolator.io/Isolated (pods/status)")
    node_views: bool = Field(True, description="annotate GPU Nodes with the node agent's status and usage (for kubectl isolator)")
    node_view_interval_s: float = Field(10.0, gt=0, description="write changed node views this often")
    node_view_heartbeat_s: float = Field(60.0, gt=0, description="rewrite an unchanged node view this often (its last-seen time)")
    health_bucket: str = Field("isolator-pod-health", pattern=r"^[A-Za-z0-9_-]+$", description="KV bucket of the verifier's per-pod keys")
    reverify_lease_ttl_s: float = Field(15.0, ge=0.5, le=300, description="replicas: one runs the periodic passes (a KV lease); "
                                        "another takes them over after this long without renewal")
