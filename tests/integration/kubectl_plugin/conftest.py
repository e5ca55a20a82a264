"""Fixtures for `kubectl isolator`: `cluster` (the real kube-apiserver, by kubeconfig) and a tenant bound to one namespace.

Every test talks to the API through `cluster.kubeconfig`, as the plugin's users do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config

from kai_isolator.services.devcluster.cluster import DevCluster
from kai_isolator.services.devcluster.plane import ApiCallError
from support.kubectl_plugin import Cluster

TENANT_ROLE = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "tenant-reader"},
               "rules": [{"apiGroups": [""], "resources": ["pods", "events"], "verbs": ["get", "list", "watch"]}]}


@pytest.fixture
def dev_cluster_options() -> dict[str, Any]:
    return {"nodes": {}}  # the tests register the nodes they show


@pytest.fixture
async def cluster(dev_cluster: DevCluster) -> AsyncIterator[Cluster]:
    api = await config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    async with api:
        yield Cluster(dev_cluster.kubeconfig, api)


@pytest.fixture
def tenant_kubeconfig(dev_cluster: DevCluster) -> Path:
    """A ServiceAccount that may read pods and events in `default` only (a Role, no cluster-wide grant), as RBAC binds a tenant."""
    plane = dev_cluster.plane
    assert plane is not None
    for path, body in (
        ("/api/v1/namespaces/default/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant"}}),
        ("/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles", TENANT_ROLE),
        ("/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings",
         {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "tenant-reader"},
          "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant-reader"},
          "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": "default"}]}),
    ):
        try:
            plane.request("POST", path, body)
        except ApiCallError as error:
            if error.code != 409:  # left by an earlier test on this session's plane: the same object
                raise
    return plane.service_account_kubeconfig("default", "tenant")
