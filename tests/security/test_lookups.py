"""In-process routes to device memory that once returned the driver's own pointer or memory the
library never saw, run for real in simulated containers under a 1 GiB grant: a second driver copy
through dlmopen, graph memory nodes, and a pool told to keep freed memory. Each ends blocked."""

from __future__ import annotations

import pytest

from security.container import CUPROBE, GIB, SimNode, blocked_or_detected, gpu_pod

ROUTES = {
    # dlmopen(LM_ID_NEWLM) + dlsym: a driver copy in a namespace of its own, where no preload applies
    "dlmopen": (["--path=dlmopen", "init", "ctx", "0", "alloc", str(2 * GIB)], "alloc"),
    "graph-alloc-node": (["init", "ctx", "0", "graphalloc", str(2 * GIB)], "graphalloc"),
    "graph-generic-node": (["--path=dlsym", "init", "ctx", "0", "graphnode", str(2 * GIB)], "graphnode"),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_routes_around_the_hooks_are_closed(node: SimNode, route: str) -> None:
    container = await node.start(gpu_pod(f"route-{route}"), limit="1g")
    script, step = ROUTES[route]
    result = await container.run([str(CUPROBE), *script])
    [line] = [line for line in result.stdout.splitlines() if line.startswith(step + " ")]
    assert " rc=0" not in line, result.stdout
    assert blocked_or_detected(container, GIB) == "blocked"


async def test_a_pool_told_to_keep_freed_memory_keeps_none(node: SimNode) -> None:
    container = await node.start(gpu_pod("route-pool-threshold"), limit="1g")
    result = await container.run([str(CUPROBE), "--path=procaddr", "init", "ctx", "0", "poolthreshold", str(8 * GIB), "poolget"])
    assert "poolget rc=0 threshold=0" in result.stdout, result.stdout  # the driver never saw the threshold
    assert blocked_or_detected(container, GIB) == "blocked"
