"""Settings of the local control plane (a dev and test fixture), from `KAI_ISOLATOR_DEVCLUSTER_*` env vars and flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class DevClusterSettings(BaseSettings):
    """Where kube-apiserver listens, where its admin kubeconfig goes, and the simulated GPU nodes."""

    model_config = SettingsConfigDict(env_prefix="KAI_ISOLATOR_DEVCLUSTER_", extra="ignore", frozen=True)

    listen: str = Field("127.0.0.1:0", description="HOST:PORT kube-apiserver serves on (port 0 = any free port)")
    kubeconfig: Path | None = Field(None, description="write the admin kubeconfig here")
    server_name: str | None = Field(None, description="the API server's name in that kubeconfig (a compose service name); also in its certificate")
    workdir: Path | None = Field(None, description="etcd data, PKI and logs (default: a temporary directory)")
    gpu_nodes: tuple[str, ...] = Field(("gpu-node-1:15360",), description="simulated GPU nodes as NAME[:GPU_MEMORY_MIB]")
    step_s: float = Field(0.2, ge=0, description="simulated scheduling / container start delay")
    real_node: bool = Field(False, description="one real GPU node (kubelet, containerd, runc) instead of simulated ones")

    @field_validator("gpu_nodes")
    @classmethod
    def _nodes_parse(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            name, _, memory = item.partition(":")
            if not name or (memory and not memory.isdigit()):
                raise ValueError(f"{item!r}: expected NAME[:GPU_MEMORY_MIB]")
        return value

    def node_specs(self) -> dict[str, int]:
        specs = {}
        for item in self.gpu_nodes:
            name, _, memory = item.partition(":")
            specs[name] = int(memory) if memory else 15360
        return specs
