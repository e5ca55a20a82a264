"""Healing.ride: a call nobody serves is asked again when the cluster heals, one left unanswered is sent again at the
heal, within a bound; a plain timeout and a cancel of the caller are as they were."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import nats.errors
import nats.js.errors
import pytest

from kai_isolator.shared import failover
from kai_isolator.shared.failover import Healing

CONNECTED = SimpleNamespace(is_closed=False)


class Calls:
    """A JetStream call's stand-in: each attempt answers with the next of `answers` (an exception is raised; None
    waits until cancelled, as a request sent into an election)."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.attempts = 0
        self.started = asyncio.Event()
        self.cancelled = 0

    async def __call__(self) -> object:
        answer = self.answers[self.attempts]
        self.attempts += 1
        self.started.set()
        if isinstance(answer, BaseException):
            raise answer
        if answer is None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return answer


async def sent(healing: Healing, call: Calls, wait_s: float = 60) -> asyncio.Task[object]:
    """A ride of `call` whose first attempt has gone out."""
    ride = asyncio.create_task(healing.ride(call, CONNECTED, wait_s=wait_s))  # type: ignore[arg-type]
    await call.started.wait()
    return ride


async def test_a_call_nobody_serves_is_asked_again_until_answered() -> None:
    call = Calls(nats.js.errors.NoStreamResponseError(), nats.js.errors.ServiceUnavailableError(), "ack")
    assert await Healing().ride(call, CONNECTED, wait_s=10) == "ack"  # type: ignore[arg-type]
    assert call.attempts == 3


async def test_the_heal_wakes_a_call_waiting_for_a_leader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "POLL_S", 3600.0)  # longer than the test may take: the heal is what ends the wait
    healing = Healing()
    call = Calls(nats.errors.NoRespondersError(), "ack")
    ride = await sent(healing, call, wait_s=7200)
    while not ride.done() and call.attempts == 1:
        healing.heal()  # again until the ride, which was refused, waits for it
        await asyncio.sleep(0)
    assert await ride == "ack"


@pytest.mark.parametrize(("ask_again_after_s", "reconnected", "sent_again"), [
    (0.0, False, True),  # a leader elected while it waited: sent again
    (3600.0, False, False),  # sent a moment ago: one advisory of a burst does not send it again
    (3600.0, True, True),  # the connection it went out on is gone: sent again however recent
])
async def test_a_heal_sends_again_what_waits_for_its_answer(monkeypatch: pytest.MonkeyPatch, ask_again_after_s: float,
                                                            reconnected: bool, sent_again: bool) -> None:
    monkeypatch.setattr(failover, "ASK_AGAIN_AFTER_S", ask_again_after_s)
    healing = Healing()
    call = Calls(None, "ack")
    ride = await sent(healing, call)
    healing.heal(reconnected=reconnected)
    if sent_again:
        assert await ride == "ack"
        assert (call.attempts, call.cancelled, healing.count) == (2, 1, 1)
        return
    await asyncio.sleep(0)
    assert call.attempts == 1 and not ride.done()
    ride.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ride


async def test_past_its_bound_the_refusal_is_the_callers() -> None:
    call = Calls(nats.js.errors.NoStreamResponseError(), "ack")
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await Healing().ride(call, CONNECTED, wait_s=0)  # type: ignore[arg-type]
    assert call.attempts == 1


async def test_a_timeout_with_no_heal_is_the_callers_as_before() -> None:
    call = Calls(nats.errors.TimeoutError(), "ack")
    with pytest.raises(nats.errors.TimeoutError):
        await Healing().ride(call, CONNECTED, wait_s=60)  # type: ignore[arg-type]


async def test_cancelling_the_caller_cancels_its_call_and_is_not_taken_for_a_heal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "ASK_AGAIN_AFTER_S", 0.0)
    healing = Healing()
    call = Calls(None, "ack")
    ride = await sent(healing, call)
    ride.cancel()
    healing.heal()  # in the same turn: the caller's cancel wins
    with pytest.raises(asyncio.CancelledError):
        await ride
    assert call.attempts == 1 and call.cancelled == 1
