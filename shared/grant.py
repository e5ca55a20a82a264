"""The grant: what one container may hold on each GPU, written by the node agent and read by libvgpu.so.

The file lives on the host at `<grant dir>/<pod uid>_<container>/grant.json` (root-owned, 0444)
and is mounted read-only at `/etc/kai-isolator/grant.json` in the container, so the tenant can
read it but never change it. libvgpu.so parses exactly this shape (hami-core/README.md).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .contract import DEFAULT_GRANT_DIR, GRANT_FILE, GRANT_MOUNT_PATH, GRANT_VOLUME  # noqa: F401  (re-exported)
from .errors import ConfigError

# Where KAI's binder learns a node's card size (MiB), and how it spells a portion.
GPU_MEMORY_NODE_LABEL = "nvidia.com/gpu.memory"
_TIB_IN_MIB = 1024 * 1024


class GrantSource(str, Enum):
    CONFIGMAP = "configmap"      # CUDA_DEVICE_MEMORY_LIMIT in the ConfigMap KAI's binder wrote
    ANNOTATION = "annotation"    # recomputed from gpu-fraction / gpu-memory and the node's card size


class DeviceGrant(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    uuid: str = Field(min_length=1)
    limit_bytes: int = Field(gt=0)


class Grant(BaseModel):
    """One container's grant. `source` says which input won; `reason` says why when they disagreed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    pod_uid: str = Field(min_length=1)
    namespace: str
    pod: str
    container: str
    devices: tuple[DeviceGrant, ...] = Field(min_length=1)
    source: GrantSource
    configmap_limit_bytes: int | None = None
    annotation_limit_bytes: int | None = None
    reason: str = ""
    written_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


def grant_dir_name(pod_uid: str, container: str) -> str:
    """The per-container directory, as the webhook's `subPathExpr: $(POD_UID)_<container>` names it."""
    return f"{pod_uid}_{container}"


def scheduler_gpu_memory_mib(label_mib: int) -> int:
    """The card size KAI's scheduler plans with: the label (bytes when ≥ 1 TiB in MiB), floored to 100."""
    size = label_mib // (1024 * 1024) if label_mib >= _TIB_IN_MIB else label_mib
    return size - size % 100


def binder_portion(annotations: dict[str, str], label_mib: int) -> str:
    """The 2-decimal portion KAI's scheduler puts in the BindRequest for a gpu-memory / gpu-fraction pod."""
    if "gpu-memory" in annotations:
        planned = scheduler_gpu_memory_mib(label_mib)
        if planned <= 0:
            raise ConfigError(f"node GPU memory label {label_mib} is too small to plan a gpu-memory request")
        portion = math.ceil(_positive_number(annotations["gpu-memory"], "gpu-memory") / planned * 100) / 100
    elif "gpu-fraction" in annotations:
        portion = _positive_number(annotations["gpu-fraction"], "gpu-fraction")
    else:
        raise ConfigError("pod has neither gpu-memory nor gpu-fraction")
    return f"{portion:.2f}"


def binder_limit_mib(label_mib: int, portion: str) -> int:
    """`int(label × portion)` MiB, truncated, from the raw label: what KAI's hamicore PreBind writes."""
    limit = int(float(label_mib) * float(portion))
    if label_mib <= 0 or limit <= 0:
        raise ConfigError(f"no limit from label {label_mib} MiB and portion {portion}")
    return limit


def annotation_limit_bytes(annotations: dict[str, str], label_mib: int) -> int:
    """The per-device limit in bytes KAI's binder would grant this pod on a card labelled `label_mib`."""
    return binder_limit_mib(label_mib, binder_portion(annotations, label_mib)) << 20


def _positive_number(value: str, name: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} annotation is not a number: {value!r}") from None
    if not number > 0 or math.isinf(number):
        raise ConfigError(f"{name} annotation must be a positive number, got {value!r}")
    return number
