"""Pods and namespaces as the tests write them: one builder for a GPU-sharing pod (KAI's annotations, KAI's scheduler,
optionally our webhook's library mount), the shapes the suites use most made from it, and fresh namespaces."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from kai_isolator.services.devcluster.kai import HOSTNAME_LABEL
from kai_isolator.services.devcluster.plane import ControlPlane
from kai_isolator.shared.contract import DEFAULT_VGPU_MOUNT, GPU_FRACTION_ANNOTATION, GPU_MEMORY_ANNOTATION, PRELOAD_PATH, VGPU_VOLUME

Obj = dict[str, Any]
KAI_SCHEDULER = "kai-scheduler"
T4 = "gpu-node-1"  # the simulated clusters' and the real node's one GPU node (a 15360 MiB T4)
_names = itertools.count()


def gpu_pod(name: str = "train-0", *, namespace: str | None = None, uid: str | Callable[[], str] | None = None,
            resource_version: str | None = None, labels: dict[str, str] | None = None, gpu_memory: str | int | None = 4096,
            gpu_fraction: str | None = None, annotations: dict[str, str] | None = None, scheduler: str | None = KAI_SCHEDULER,
            node: str | None = None, node_name: str | None = None, container: str = "main", image: str | None = "busybox",
            command: list[str] | None = None, pull_policy: str | None = None, containers: list[Obj] | None = None,
            inits: tuple[str, ...] = (), injected: bool = False, **spec: Any) -> Obj:
    """A pod asking for a GPU share as KAI's users write it.

    Its share: `gpu_memory` (MiB) and/or `gpu_fraction`, then `annotations` (None for either leaves it out). It names
    KAI's `scheduler` (None: the default scheduler's); `node` pins it with a hostname nodeSelector, `node_name` has it
    bound already. One `container` runs `image` (None: no image) with `command`, or `containers` replace it; `inits`
    adds init containers by name. `injected`: it already carries our webhook's library mount (where no webhook of ours
    is registered, the mount stands for its work). `uid` may be a callable that makes each pod its own. What is left
    goes into the spec as it is."""
    metadata = _given(name=name, namespace=namespace, uid=uid() if callable(uid) else uid, resourceVersion=resource_version, labels=labels)
    metadata["annotations"] = {**_given(**{GPU_MEMORY_ANNOTATION: None if gpu_memory is None else str(gpu_memory),
                                           GPU_FRACTION_ANNOTATION: gpu_fraction}), **(annotations or {})}
    # A copy of `command`: a default bound once (functools.partial) must not be shared by the pods made from it.
    main = _given(name=container, image=image, imagePullPolicy=pull_policy, command=list(command) if command else None)
    body = _given(schedulerName=scheduler, containers=containers or [main],
                  initContainers=[{"name": init, "image": "busybox"} for init in inits] or None,
                  nodeSelector={HOSTNAME_LABEL: node} if node else None, nodeName=node_name)
    if injected:
        body["volumes"] = [{"name": VGPU_VOLUME, "hostPath": {"path": DEFAULT_VGPU_MOUNT, "type": "Directory"}}]
        main["volumeMounts"] = [{"name": VGPU_VOLUME, "mountPath": PRELOAD_PATH, "subPath": "ld.so.preload", "readOnly": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {**body, **spec}}


def kai_pod(name: str, *, node: str = T4, scheduler: str | None = KAI_SCHEDULER, inits: tuple[str, ...] = (), **annotations: str) -> Obj:
    """A pod for KAI to place on `node`, its share only what `annotations` say (the suites that hold KAI's arithmetic
    to its source spell each share out)."""
    return gpu_pod(name, gpu_memory=None, annotations=annotations, scheduler=scheduler, node=node, inits=inits)


def cuda_pod(name: str, image: str, gpu_memory_mib: int, command: list[str], annotations: dict[str, str] | None = None,
             *, pull_policy: str | None = None) -> Obj:
    """A GPU-sharing pod on the real node, its `cuda` container running `command` in `image` (KAI's scheduler binds it)."""
    return gpu_pod(name, namespace="default", gpu_memory=gpu_memory_mib, annotations=annotations, container="cuda", image=image,
                   command=command, pull_policy=pull_policy, terminationGracePeriodSeconds=1)


def _given(**fields: Any) -> Obj:
    """The fields that have a value: a field left unset is absent from the pod, as a user's manifest leaves it out."""
    return {key: value for key, value in fields.items() if value is not None}


def unique_name(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


def make_namespace(plane: ControlPlane, prefix: str = "test", labels: dict[str, str] | None = None) -> str:
    """A fresh namespace with its `default` ServiceAccount (which the controller-manager, absent here, would create)."""
    name = unique_name(prefix)
    plane.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": name, "labels": labels or {}}})
    plane.request("POST", f"/api/v1/namespaces/{name}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                                         "metadata": {"name": "default"}})
    return name
