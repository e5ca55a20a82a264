"""Memory over the grant per escape class on both kinds of node (issue 41): the red team's escapes past the library
(tests/security/escapes.py) on an R580 node, held by the library and the enforcer at its shipped defaults (the
baseline), and on an R615 node, whose driver caps each container's leaf as it starts. Per class: the peak the node's
driver held past the grants and the MiB·s over them (sampled every 20 ms), and the ratio R615 / R580. Needs root
(cgroups, mount namespaces). Prints figures only."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the security tests' nodes and escapes

from kai_isolator.shared.cgroups import CgroupDriver  # noqa: E402
from security.container import SimNode  # noqa: E402
from security.escapes import ESCAPES, Escape, Outcome, run  # noqa: E402

BRANCHES = (580, 615)
RUNS = int(os.environ.get("BENCH_DRIVER_CAP_RUNS", "1"))


async def once(escape: Escape, branch: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="kai-bench-cap-") as scratch:
        node = SimNode(Path(scratch) / "host", Path(scratch), CgroupDriver.CGROUPFS, driver_branch=branch)
        try:
            return await run(node, escape)
        finally:
            await node.stop()


async def measure() -> dict[tuple[str, int], list[Outcome]]:
    found: dict[tuple[str, int], list[Outcome]] = {}
    for _ in range(RUNS):
        for escape in ESCAPES:
            for branch in BRANCHES:
                found.setdefault((escape.row, branch), []).append(await once(escape, branch))
    return found


def worst(outcomes: list[Outcome]) -> tuple[int, float]:
    return max(o.peak_over_mib for o in outcomes), max(o.over_mib_s for o in outcomes)


def main() -> int:
    if os.geteuid() != 0:
        print("bench/driver_cap.py needs root (cgroups, mount namespaces)", file=sys.stderr)
        return 1
    logging.disable(logging.WARNING)  # each kill is logged; the figures are what this prints
    found = asyncio.run(measure())
    print(f"memory past the grant per escape class, worst of {RUNS} run(s), R580 (library and enforcer, the baseline) "
          "against R615 (driver-capped)")
    print(f"{'row':<4} {'escape':<38} {'R580 peak':>10} {'R580 MiB*s':>11} {'R615 peak':>10} {'R615 MiB*s':>11} {'ratio':>6}")
    for escape in ESCAPES:
        (old_peak, old_area), (new_peak, new_area) = (worst(found[(escape.row, b)]) for b in BRANCHES)
        ratio = f"{new_area / old_area:.2f}" if old_area else "-"
        print(f"{escape.row:<4} {escape.name:<38} {old_peak:>6} MiB {old_area:>11.0f} {new_peak:>6} MiB {new_area:>11.0f} {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
