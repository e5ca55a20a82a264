"""The red team's escapes past the library on a driver-capped node (issue 41): the fake driver as R615 (NVML 13.4's
per-cgroup memory limits), each container's cgroup v2 leaf capped as it starts by the node agent's own creation gate
(what its NRI plugin asks at StartContainer), and the agent's enforcer looping at its shipped defaults, as it does in
every mode. The driver refuses every allocation past the grant (CUDA_ERROR_OUT_OF_MEMORY), so the ledger never holds
more than the grants and nothing is killed; a cgroup the tenant makes below its leaf is not capped, and the enforcer
catches it as on R580. Each escape adds its row to the table's driver-capped column."""

from __future__ import annotations

import pytest

from security.container import SimNode
from security.escapes import ESCAPES, Escape, run
from support import run_summary

DRIVER_BRANCH = 615  # the security conftest's nodes: NVML 13.4's limits, each container's leaf capped as it starts
SECTION = "the red team on a driver-capped node, R615 (tests/security/test_driver_capped.py)"
HEADER = f"{'row':<4} {'escape':<40} {'refused':>8} {'peak over':>10} {'MiB*s over':>11}  outcome"


@pytest.mark.parametrize("escape", ESCAPES, ids=[e.row for e in ESCAPES])
async def test_the_driver_refuses_every_escape_past_the_grant(node: SimNode, escape: Escape) -> None:
    outcome = await run(node, escape)
    attempt = outcome.attempt
    if escape.capped:
        assert attempt.allocated == 0 or outcome.peak_over_mib == 0, attempt.answers
        assert outcome.peak_over_mib == 0 and outcome.over_mib_s == 0, f"the driver held {outcome.peak_over_mib} MiB past the grant"
        assert attempt.refused >= 1, attempt.answers
        assert not outcome.acted, "the enforcer acted on a container the driver held to its grant"
        result = "refused by the driver, nothing killed"
    else:
        assert attempt.allocated == 1 and outcome.acted, (attempt.answers, outcome)
        result = "not capped (a cgroup below the leaf): killed by the enforcer"
    run_summary.add(SECTION, f"{escape.row:<4} {escape.name + f' [{node.driver.value}]':<40} {attempt.refused:>8} "
                             f"{outcome.peak_over_mib:>6} MiB {outcome.over_mib_s:>11.0f}  {result}", header=HEADER)
