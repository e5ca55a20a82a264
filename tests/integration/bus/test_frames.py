"""shared.frames: the frame it queues is the one nats-py's publish would queue, and a real server stores it so."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import nats.errors
import orjson
import pytest
from nats.aio.client import Client as NatsClient

from kai_isolator.shared import frames
from kai_isolator.shared.embedded_nats import EmbeddedNats

HEADERS = {"Nats-Msg-Id": "admission:3f1c9a2e-uid", "Content-Type": "application/cloudevents+json"}


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NatsClient]:
    client = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    yield client
    if not client.is_closed:
        await client.close()


def captured(nc: NatsClient, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    sent: list[bytes] = []
    original = nc._send_command

    async def send_command(cmd: bytes, priority: bool = False) -> None:
        sent.append(bytes(cmd))
        await original(cmd, priority)

    monkeypatch.setattr(nc, "_send_command", send_command)
    return sent


@pytest.mark.parametrize("headers", [HEADERS, {"Nats-Msg-Id": "w:ns/pod:7"}, {}])
async def test_the_frame_is_byte_for_byte_what_publish_sends(nc: NatsClient, monkeypatch: pytest.MonkeyPatch, headers: dict[str, str]) -> None:
    sent = captured(nc, monkeypatch)
    await nc.publish("isolator.admission.team-a", b'{"x":1}', reply="_INBOX.abc.17", headers=headers)
    await frames.publish(nc, "isolator.admission.team-a", b'{"x":1}', "_INBOX.abc.17", headers)
    assert len(sent) == 2 and sent[0] == sent[1]
    assert nc.stats["out_msgs"] == 2


@pytest.mark.parametrize("headers", [
    {"Nats-Msg-Id": "admission:u\r\nNats-Expected-Stream: OTHER"},  # a header smuggled in a request uid
    {"Nats-Msg-Id": "has a space"},
    {"Bad Name": "v"},
    {"Nats-Msg-Id": "ünïcode"},
])
async def test_what_needs_cleaning_goes_through_publish(nc: NatsClient, monkeypatch: pytest.MonkeyPatch, headers: dict[str, str]) -> None:
    sent = captured(nc, monkeypatch)
    try:
        await nc.publish("s.a", b"d", reply="r.1", headers=headers)
    except nats.errors.Error as error:
        with pytest.raises(type(error)):
            await frames.publish(nc, "s.a", b"d", "r.1", headers)
        return
    await frames.publish(nc, "s.a", b"d", "r.1", headers)
    assert len(sent) == 2 and sent[0] == sent[1]
    assert b"\r\nNats-Expected-Stream" not in sent[1]


async def test_a_stream_stores_it_with_its_headers_and_deduplicates_by_msg_id(nc: NatsClient) -> None:
    js = nc.jetstream()
    await js.add_stream(name="FRAMES", subjects=["frames.>"])
    inbox = nc.new_inbox()
    acks: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_ack(msg: object) -> None:
        await acks.put(msg.data)  # type: ignore[attr-defined]

    await nc.subscribe(inbox + ".*", cb=on_ack)
    for token in ("1", "2"):  # the same Nats-Msg-Id twice
        await frames.publish(nc, "frames.one", b'{"n":1}', f"{inbox}.{token}", HEADERS)
    first, second = await asyncio.wait_for(acks.get(), 5), await asyncio.wait_for(acks.get(), 5)
    assert orjson.loads(first) == {"stream": "FRAMES", "seq": 1}
    assert orjson.loads(second) == {"stream": "FRAMES", "seq": 1, "duplicate": True}  # written `"duplicate": true`, with a space
    stored = await js.get_msg("FRAMES", 1)
    assert stored.data == b'{"n":1}' and stored.headers is not None
    assert {k: stored.headers[k] for k in HEADERS} == HEADERS


async def test_errors_match_publish(nc: NatsClient) -> None:
    with pytest.raises(nats.errors.MaxPayloadError):
        await frames.publish(nc, "s.a", b"x" * (nc.max_payload + 1), "r.1", HEADERS)
    await nc.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await frames.publish(nc, "s.a", b"d", "r.1", HEADERS)


async def test_many_go_out_in_order_as_publish_sends_them_one_by_one(nc: NatsClient, monkeypatch: pytest.MonkeyPatch) -> None:
    messages: list[frames.Message] = [
        ("s.a", b"1", "r.1", HEADERS),
        ("s.b", b"2", "r.2", {"Nats-Msg-Id": "needs cleaning\r\n"}),  # sent by nats-py in its turn
        ("s.c", b"3", "r.3", {}),
    ]
    sent = captured(nc, monkeypatch)
    for subject, data, reply, headers in messages:
        await nc.publish(subject, data, reply=reply, headers=dict(headers))
    one_by_one = b"".join(sent)
    sent.clear()
    await frames.publish_many(nc, messages)
    assert b"".join(sent) == one_by_one
    assert nc.stats["out_msgs"] == 6


async def test_nothing_is_queued_on_a_closed_connection(nc: NatsClient) -> None:
    await nc.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await frames.publish_many(nc, [("s.a", b"1", "r.1", HEADERS), ("s.b", b"2", "r.2", HEADERS)])
    assert nc.stats["out_msgs"] == 0


async def test_sent_while_reconnecting_it_is_kept_and_stored_once_the_server_is_back(nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        await nc.jetstream().add_stream(name="FRAMES", subjects=["frames.>"])
        inbox = nc.new_inbox()
        acks: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_ack(msg: object) -> None:
            await acks.put(msg.data)  # type: ignore[attr-defined]

        await nc.subscribe(inbox + ".*", cb=on_ack)
        await nc.flush()
        nats_server.kill()
        while nc.is_connected:
            await asyncio.sleep(0.02)
        await frames.publish(nc, "frames.kept", b'{"n":2}', f"{inbox}.1", HEADERS)  # buffered by the client, as publish does
        nats_server.start()
        assert orjson.loads(await asyncio.wait_for(acks.get(), 15)) == {"stream": "FRAMES", "seq": 1}
    finally:
        await nc.close()
