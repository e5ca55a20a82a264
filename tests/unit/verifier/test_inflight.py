"""Verifications in flight: one at a time per pod, a pass that does not wait, nothing kept once done."""

from __future__ import annotations

import asyncio

from kai_isolator.services.verifier.inflight import InFlight


async def test_a_second_claim_waits_for_the_first_and_a_pass_does_not_wait() -> None:
    in_flight = InFlight()
    order: list[str] = []
    first_holds, release = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        async with in_flight.claim("a") as claimed:
            assert claimed
            order.append("first")
            first_holds.set()
            await release.wait()
        order.append("first done")

    async def second() -> None:
        async with in_flight.claim("a") as claimed:
            assert claimed
            order.append("second")

    one = asyncio.create_task(first())
    await first_holds.wait()
    two = asyncio.create_task(second())
    await asyncio.sleep(0)
    async with in_flight.claim("a", wait=False) as claimed:
        assert not claimed  # held: a pass leaves it alone
    async with in_flight.claim("b", wait=False) as claimed:
        assert claimed  # another pod is free
    assert in_flight.busy("a") and order == ["first"]
    release.set()
    await asyncio.gather(one, two)
    assert order == ["first", "first done", "second"]
    assert not in_flight.busy("a") and len(in_flight) == 0
