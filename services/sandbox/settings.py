"""Settings of the sandbox API server (a test/demo fixture), from `KAI_ISOLATOR_SANDBOX_*` env vars and flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SandboxSettings(BaseSettings):
    """How the sandbox listens, how much history it keeps, and its simulated nodes."""

    model_config = SettingsConfigDict(env_prefix="KAI_ISOLATOR_SANDBOX_", extra="ignore", frozen=True)

    listen: str = Field("127.0.0.1:0", description="HOST:PORT to serve on (port 0 = any free port)")
    kubeconfig: Path | None = Field(None, description="write a kubeconfig pointing at this server here")
    retained_events: int = Field(10_000, ge=1, description="changes kept for watches; older resourceVersions answer 410 Gone")
    bookmark_interval_s: float = Field(30.0, gt=0, description="bookmark period on watches that allow them")
    watch_timeout_s: float = Field(1800.0, gt=0, description="longest a watch stays open (timeoutSeconds may ask for less)")
    node_step_s: float = Field(0.2, ge=0, description="simulated scheduling / container start delay")
    gpu_nodes: tuple[str, ...] = Field(("gpu-node-1:15360",), description="simulated GPU nodes as NAME[:GPU_MEMORY_MIB]")

    def node_specs(self) -> list[tuple[str, int]]:
        specs = []
        for item in self.gpu_nodes:
            name, _, memory = item.partition(":")
            specs.append((name, int(memory) if memory else 15360))
        return specs
