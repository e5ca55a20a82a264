"""Pipelined publishes: many acks in flight on one subscription, each answer (or its absence) back to its own publish."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import nats
import nats.aio.msg
import nats.js.errors
import orjson
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import StreamConfig

from kai_isolator.services.watcher.acks import Ack, AckPipeline
from kai_isolator.services.watcher.wire import encode_event
from kai_isolator.shared.embedded_nats import EmbeddedNats
from kai_isolator.shared.events import PodIsolation, PodRef, Reason, decode, encode


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NatsClient]:
    client = await nats.connect(nats_server.url)
    await client.jetstream().add_stream(StreamConfig(name="T", subjects=["t.>"]))
    yield client
    await client.close()


async def test_many_in_flight_each_get_their_own_ack(nc: NatsClient) -> None:
    acks = AckPipeline(nc, timeout_s=5, limit=16)
    await acks.start()
    try:
        answers = await asyncio.gather(*(acks.publish(f"t.{i}", b"x", {"Nats-Msg-Id": str(i)}) for i in range(200)))
        assert sorted(a.seq for a in answers) == list(range(1, 201)) and not any(a.duplicate for a in answers)
        again = await acks.publish("t.7", b"x", {"Nats-Msg-Id": "7"})
        assert again.duplicate
        assert acks.in_flight == 0
    finally:
        await acks.stop()


async def test_a_refusal_is_raised_with_its_code(nc: NatsClient) -> None:
    acks = AckPipeline(nc, timeout_s=5)
    await acks.start()
    try:
        await acks.publish("t.a", b"x", {"Nats-Expected-Last-Subject-Sequence": "0"})
        with pytest.raises(nats.js.errors.APIError) as fenced:
            await acks.publish("t.a", b"x", {"Nats-Expected-Last-Subject-Sequence": "0"})
        assert fenced.value.err_code == 10071
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await acks.publish("nowhere", b"x", {})
    finally:
        await acks.stop()


async def test_a_missing_ack_times_out(nc: NatsClient) -> None:
    await nc.subscribe("silent")  # takes the message, never answers
    acks = AckPipeline(nc, timeout_s=0.2)
    await acks.start()
    try:
        with pytest.raises(asyncio.TimeoutError):
            await acks.publish("silent", b"x", {})
        assert acks.in_flight == 0
    finally:
        await acks.stop()


async def test_a_lost_connection_sends_what_awaits_its_ack_again_at_once(nc: NatsClient) -> None:
    # As when the server a message went through dies with its ack: the copy sent again gets the answer,
    # and an answer to the first copy (a late one) is ignored.
    copies: list[str] = []

    async def take(msg: nats.aio.msg.Msg) -> None:
        copies.append(msg.reply)

    await nc.subscribe("silent", cb=take)
    acks = AckPipeline(nc, timeout_s=30)
    await acks.start()
    try:
        waiting = asyncio.create_task(acks.publish("silent", b"x", {"Nats-Msg-Id": "m"}))
        while len(copies) < 1:
            await asyncio.sleep(0.01)
        await acks.resend()
        while len(copies) < 2:
            await asyncio.sleep(0.01)
        assert copies[0] != copies[1]
        await nc.publish(copies[0], orjson.dumps({"stream": "T", "seq": 1}))
        await nc.publish(copies[1], orjson.dumps({"stream": "T", "seq": 1, "duplicate": True}))
        assert await asyncio.wait_for(waiting, 5) == Ack(1, True)
        assert acks.in_flight == 0
    finally:
        await acks.stop()


async def test_through_a_server_restart_the_message_sent_again_is_stored_once(nats_server: EmbeddedNats, nc: NatsClient) -> None:
    # The ack timeout is out of reach (30 s): only the copy sent again on reconnect can be answered in time.
    acks = AckPipeline(nc, timeout_s=30)
    nc._disconnected_cb = acks.resend  # what Runtime.on_disconnected does for the watcher
    await acks.start()
    try:
        await acks.publish("t.before", b"x", {"Nats-Msg-Id": "before"})
        assert nats_server._process is not None
        nats_server._process.send_signal(signal.SIGSTOP)  # the messages reach its socket, never the server
        waiting = [asyncio.create_task(acks.publish(f"t.{i}", b"x", {"Nats-Msg-Id": str(i)})) for i in range(20)]
        await asyncio.sleep(0.3)
        nats_server.kill()
        nats_server.start()
        answers = await asyncio.wait_for(asyncio.gather(*waiting), 20)
        assert len({a.seq for a in answers}) == 20
        info = await nc.jetstream().stream_info("T")
        assert info.state.messages == 21
    finally:
        await acks.stop()


@pytest.mark.parametrize("event", [
    PodIsolation(pod=PodRef(namespace="ns", name="p", uid="u"), resource_version="7", state="admitted", gpu_memory="4096"),
    PodIsolation(pod=PodRef(namespace="ns", name="p", uid="u"), resource_version="8", state="isolation-missing", injected=False,
                 reasons=[Reason(code="not-injected", message="no mount")], expected_limit="4147m", node_name="n", phase="Pending"),
])
def test_the_fast_encoding_is_the_shared_one(event: PodIsolation) -> None:
    fast, shared = orjson.loads(encode_event(event, "watcher")), orjson.loads(encode(event, "watcher"))
    assert fast.pop("time").endswith("Z") and shared.pop("time")
    assert fast == shared
    assert decode(encode_event(event, "watcher"))[1] == event
