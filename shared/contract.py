"""The names the isolator shares with Kubernetes, KAI-Scheduler and libvgpu.so: annotations,
injected volumes, paths and environment variables. Services spell them only through here."""

from __future__ import annotations

# Annotations KAI-Scheduler reads on GPU-sharing pods, and our opt-out.
GPU_FRACTION_ANNOTATION = "gpu-fraction"
GPU_MEMORY_ANNOTATION = "gpu-memory"
FRACTION_CONTAINER_ANNOTATION = "gpu-fraction-container-name"
NUM_DEVICES_ANNOTATION = "gpu-fraction-num-devices"
# KAI's admission names every GPU-sharing pod's ConfigMaps here; its binder writes them under that name.
KAI_CONFIGMAP_ANNOTATION = "runai/shared-gpu-configmap"
# What KAI books a pod's share from and where it writes the share down: fixed once the pod exists, since the node's
# grant is computed from them (the webhook refuses an update that changes any).
GPU_REQUEST_ANNOTATIONS = (GPU_FRACTION_ANNOTATION, GPU_MEMORY_ANNOTATION, NUM_DEVICES_ANNOTATION, FRACTION_CONTAINER_ANNOTATION,
                           KAI_CONFIGMAP_ANNOTATION)
INJECT_ANNOTATION = "kai-resource-isolator.io/inject"
# KAI's binder reserves each shared GPU with a pod of its own in its reservation namespace, labelled with the GPU
# group; the pod's program writes the GPU's UUID on it. The sharing pods of that GPU carry the group as a label
# (`runai-gpu-group`, or one `runai-gpu-group/<group>` per device when they asked for several).
GPU_GROUP_LABEL = "runai-gpu-group"
RESERVATION_NAMESPACE = "kai-resource-reservation"
RESERVED_GPU_ANNOTATION = "run.ai/reserve_for_gpu_index"

# What the webhook injects.
VGPU_VOLUME = "kai-resource-isolator-vgpu"
STATE_VOLUME = "kai-resource-isolator-state"
PRELOAD_PATH = "/etc/ld.so.preload"
PRELOAD_SUBPATH = "ld.so.preload"
DEFAULT_VGPU_MOUNT = "/usr/local/vgpu"
DEFAULT_STATE_DIR = "/var/lib/kai-isolator/containers"
# Where a container sees its own state directory; kept outside the read-only library dir.
STATE_MOUNT_PATH = "/run/kai-isolator"
USAGE_CACHE_PATH = f"{STATE_MOUNT_PATH}/usage.cache"
# The node-written grant (shared/grant.py): a root-owned host dir, one subdir per container,
# mounted read-only where the library looks for it.
GRANT_VOLUME = "kai-resource-isolator-grant"
DEFAULT_GRANT_DIR = "/var/lib/kai-isolator/grants"
GRANT_MOUNT_PATH = "/etc/kai-isolator"
GRANT_FILE = "grant.json"

# libvgpu.so's environment contract (hami-core/README.md) and what the webhook sets beside it.
LIMIT_ENV = "CUDA_DEVICE_MEMORY_LIMIT"
SHARED_CACHE_ENV = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
POD_UID_ENV = "POD_UID"
CONTAINER_NAME_ENV = "CONTAINER_NAME"
CONTAINER_VGPU_MOUNT_ENV = "CONTAINER_VGPU_MOUNT"


def is_gpu_sharing(annotations: dict[str, str]) -> bool:
    return GPU_FRACTION_ANNOTATION in annotations or GPU_MEMORY_ANNOTATION in annotations


def gpu_group_labels(labels: dict[str, str]) -> dict[str, str]:
    """The GPU-group labels among a pod's labels, as KAI's binder writes them."""
    return {key: value for key, value in labels.items() if key == GPU_GROUP_LABEL or key.startswith(GPU_GROUP_LABEL + "/")}


def gpu_groups(labels: dict[str, str]) -> frozenset[str]:
    """The GPU groups a pod's labels name."""
    return frozenset(gpu_group_labels(labels).values())
