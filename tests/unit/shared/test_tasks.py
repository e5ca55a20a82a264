"""cancel_all ends loops for sure, even one that carries on after its cancel came out as a timeout."""

from __future__ import annotations

import asyncio

from kai_isolator.shared.tasks import cancel_all


async def test_a_loop_that_swallows_its_cancel_as_a_timeout_still_ends() -> None:
    swallowed = 0

    async def retrying_loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:  # the second cancel is let through
                    raise
                swallowed += 1  # like a client timeout racing the cancel: "timed out", retry
                continue

    loops = [asyncio.create_task(retrying_loop()), asyncio.create_task(asyncio.sleep(3600))]
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all(loops, recancel_s=0.05), 5)
    assert swallowed == 1 and all(task.done() for task in loops)
    # A single cancel, as the services' stop did before, leaves that loop running for good.
    stubborn = asyncio.create_task(retrying_loop())
    swallowed = 0
    await asyncio.sleep(0)
    stubborn.cancel()
    done, _ = await asyncio.wait({stubborn}, timeout=0.2)
    assert not done
    await cancel_all([stubborn], recancel_s=0.05)
