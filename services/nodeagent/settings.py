"""Settings of the node agent (env `KAI_ISOLATOR_*`, flags override)."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from kai_isolator.shared import subjects
from kai_isolator.shared.contract import DEFAULT_GRANT_DIR, RESERVATION_NAMESPACE
from kai_isolator.shared.settings import _Settings

from .enforce import DEFAULT_TOLERANCE_MIB
from .layout import DEFAULT_MOUNT
from .nvml import DEFAULT_LIBRARY

NODE_BUCKET = subjects.NODE_STATUS_BUCKET
"""KV bucket: node name -> the agent's latest NodeStatus (the installer reads it too)."""


class NodeAgentSettings(_Settings):
    node_name: str | None = Field(None, description="this node's Kubernetes name (else env NODE_NAME)")
    host_root: Path = Field(Path("/host-root"), description="the host's / as mounted into the agent")
    container_vgpu_mount: str = Field(DEFAULT_MOUNT, description="library directory, same path on the host and in containers")
    proc_root: Path = Field(Path("/proc"), description="the host's /proc (the agent runs with hostPID)")
    library: list[Path] = Field(default_factory=list, description="library builds this agent carries; the first is installed when none is")
    install_on_start: bool = Field(True, description="install the first carried library when the node has none")
    status_interval_s: float = Field(30.0, gt=0, description="self-check, GC and status report period")
    usage_interval_s: float = Field(15.0, gt=0, description="usage.cache scan and UsageReport period")
    gc_grace_s: float = Field(60.0, ge=0, description="keep a retired version at least this long, for processes starting at the switch")
    inspect_timeout_s: float = Field(3.0, gt=0, description="an inspection taking longer is answered as not found, with the reason")
    self_check_timeout_s: float = Field(10.0, gt=0, description="a self-check probe still running after this long fails the check")
    self_check_command: list[str] | None = Field(None, description="probe run with LD_PRELOAD=libvgpu.so; default: check /proc/self/maps")
    grant_dir: str = Field(DEFAULT_GRANT_DIR, description="host directory of per-container grants (under --host-root); the webhook mounts it read-only")
    kubeconfig: Path | None = Field(None, description="kubeconfig for reading this node's pods; unset = in-cluster service account")
    reservation_namespace: str = Field(RESERVATION_NAMESPACE, min_length=1, description="KAI's namespace for its GPU reservation pods "
                                                                                        "(its binder's --resource-reservation-namespace): a "
                                                                                        "grant names only GPUs they hold")
    enforce: bool = Field(True, description="hold every GPU-sharing container to its grant from the driver's view (NVML)")
    enforce_interval_s: float = Field(1.0, gt=0, le=60, description="how often the enforcer reads every process's device memory from NVML")
    on_breach: Literal["kill", "evict", "warn"] = Field("kill", description="kill the container's biggest processes until it is under "
                                                                            "its grant, evict the pod, or only report")
    breach_tolerance_mib: int = Field(DEFAULT_TOLERANCE_MIB, ge=0, description="allowed per container and device over the grant, however "
                                                                              "many processes it runs, for what the driver reserves for "
                                                                              "contexts (NVML counts it, the library does not); none where "
                                                                              "nothing is granted")
    nvml_library: str = Field(DEFAULT_LIBRARY, min_length=1, description="the NVML library the enforcer loads (soname or path)")
    nri_socket: Path | None = Field(None, description="the decision socket the NRI plugin (kai-isolator-nri) asks at container "
                                                     "creation and start; unset = no NRI, the library and the enforcer only")
    nri_hold_s: float = Field(1.5, gt=0, lt=2.0, description="how long creation waits for a container's grant before refusing (the "
                                                             "kubelet retries); under containerd's plugin_request_timeout (2 s)")

    @field_validator("grant_dir")
    @classmethod
    def _grant_dir(cls, value: str) -> str:
        if not value.startswith("/") or value.startswith("//") or value == "/" or posixpath.normpath(value) != value:
            raise ValueError(f"--grant-dir must be a normalised absolute directory other than /, got {value!r}")
        return value
