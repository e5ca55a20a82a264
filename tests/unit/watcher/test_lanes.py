"""Ordered lanes and the resume point: one pod's changes in order, pods side by side, no version passed too early."""

from __future__ import annotations

import asyncio

import pytest

from kai_isolator.services.watcher.lanes import Lanes, Progress


def test_the_resume_point_passes_only_changes_with_none_unhandled_before() -> None:
    progress = Progress(limit=100)
    first, second, third = progress.enter("10"), progress.enter("11"), progress.enter("12")
    progress.finish(third)
    progress.finish(second)
    assert progress.handled is None  # 10 is still being handled: nothing after it counts yet
    progress.finish(first)
    assert progress.handled == "12" and len(progress) == 0 and progress.advanced == 3


def test_changes_with_nothing_to_do_and_relist_items_wait_their_turn() -> None:
    progress = Progress(limit=100)
    pending = progress.enter("20")
    progress.enter("21", done=True)  # a bookmark, or a pod that shares no GPU
    relist_item = progress.enter(None)
    assert progress.handled is None
    progress.finish(pending)
    assert progress.handled == "21"
    progress.finish(relist_item)
    assert progress.handled == "21"  # an item without a version never moves the resume point


async def test_the_limit_holds_the_reader_until_a_change_is_handled() -> None:
    progress = Progress(limit=2)
    first = progress.enter("1")
    progress.enter("2")
    room = asyncio.create_task(progress.room())
    await asyncio.sleep(0)
    assert not room.done()
    progress.finish(first)
    await asyncio.wait_for(room, 1)


async def test_one_key_runs_in_order_while_other_keys_overlap() -> None:
    progress = Progress(limit=1000)
    lanes = Lanes(8, progress)
    log: list[tuple[str, int]] = []
    running = 0
    most = 0

    async def work(key: str, n: int, delay: float) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(delay)
        log.append((key, n))
        running -= 1

    keys = [f"ns/pod-{k}" for k in range(16)]
    for n in range(5):
        for k, key in enumerate(keys):
            lanes.submit(key, str(n * 100 + k), work, key, n, 0.001 * ((n + k) % 3))
    runner = asyncio.create_task(lanes.run())
    await asyncio.wait_for(progress.drained(), 10)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    for key in keys:
        assert [n for k, n in log if k == key] == [0, 1, 2, 3, 4]
    assert most > 1  # different pods really were in flight together
    assert progress.handled == "415"  # the last one submitted


async def test_a_failed_action_ends_the_lanes_and_nothing_after_it_on_that_lane_runs() -> None:
    progress = Progress(limit=100)
    lanes = Lanes(2, progress)
    ran: list[str] = []

    async def fail() -> None:
        raise RuntimeError("fenced")

    async def note(what: str) -> None:
        ran.append(what)

    lanes.submit("ns/a", "1", fail)
    lanes.submit("ns/a", "2", note, "after the failure")
    with pytest.raises(BaseExceptionGroup) as caught:
        await asyncio.wait_for(lanes.run(), 5)
    assert isinstance(caught.value.exceptions[0], RuntimeError)
    assert "after the failure" not in ran
    assert progress.handled is None
