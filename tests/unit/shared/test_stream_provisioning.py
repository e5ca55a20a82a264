"""Stream provisioning tells a server that is offline for a moment from a cluster too small for the replicas asked.

The refusals are the real nats-server's answers: "peer offline" from loaded run L24, where a node agent started while
the meta leader had not yet heard from a freshly started member; the bare one from a 3-server cluster asked for 5.
"""

from __future__ import annotations

from typing import Any

import nats.js.errors
import pytest
from nats.js.api import StreamConfig

from kai_isolator.shared import bus
from kai_isolator.shared.errors import BusError
from kai_isolator.shared.settings import BusSettings

PEER_OFFLINE = {"code": 400, "err_code": 10005, "description": "no suitable peers for placement, peer offline"}
TOO_FEW_SERVERS = {"code": 400, "err_code": 10005, "description": "no suitable peers for placement"}


class RefusingJetStream:
    """A JetStream API with no stream yet, refusing the first `refusals` creates with `refusal`."""

    def __init__(self, refusal: dict[str, Any], refusals: int) -> None:
        self.refusal, self.refusals, self.creates = refusal, refusals, 0
        self.created: StreamConfig | None = None

    async def stream_info(self, name: str) -> Any:
        raise nats.js.errors.NotFoundError(code=404, err_code=10059, description="stream not found")

    async def add_stream(self, config: StreamConfig) -> None:
        self.creates += 1
        if self.creates <= self.refusals:
            raise nats.js.errors.BadRequestError(**self.refusal)
        self.created = config


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The backoff is recorded rather than slept: the bound is under test, not the clock."""
    slept: list[float] = []

    async def record(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(bus.asyncio, "sleep", record)
    return slept


async def test_a_peer_offline_for_a_while_is_waited_out() -> None:
    js = RefusingJetStream(PEER_OFFLINE, refusals=4)
    await bus.provision_stream(js, BusSettings(nats_replicas=3))  # type: ignore[arg-type]
    assert js.created is not None and js.created.num_replicas == 3 and js.creates == 5


async def test_a_peer_that_stays_offline_ends_in_a_clear_error_after_the_bound(no_waiting: list[float]) -> None:
    js = RefusingJetStream(PEER_OFFLINE, refusals=1_000)
    with pytest.raises(BusError, match=r"peer offline; a JetStream server stayed offline for about 26 s and 3 replicas need 3 servers up"):
        await bus.provision_stream(js, BusSettings(nats_replicas=3))  # type: ignore[arg-type]
    assert js.creates == bus.PROVISION_ATTEMPTS and sum(no_waiting) == bus.PROVISION_WAIT_S


async def test_too_few_servers_is_refused_at_once() -> None:
    js = RefusingJetStream(TOO_FEW_SERVERS, refusals=1_000)
    with pytest.raises(BusError, match=r"5 replica.*needs a JetStream cluster of at least 5 servers"):
        await bus.provision_stream(js, BusSettings(nats_replicas=5))  # type: ignore[arg-type]
    assert js.creates == 1
