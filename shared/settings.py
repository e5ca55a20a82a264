"""Typed settings, one object per concern, from `KAI_ISOLATOR_*` env vars; flags override env."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigError

ENV_PREFIX = "KAI_ISOLATOR_"


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)


class BusSettings(_Settings):
    """Where the NATS server is and how the runtime treats messages."""

    nats_url: str | None = Field(None, description="NATS server URL(s), comma separated; unset = start an embedded server")
    nats_user: str | None = Field(None, description="NATS user name (with the password)")
    nats_password: str | None = Field(None, description="NATS password")
    nats_token: str | None = Field(None, description="NATS token")
    nats_creds_file: Path | None = Field(None, description="NATS .creds file (JWT + nkey)")
    nats_tls_ca_file: Path | None = Field(None, description="CA bundle the NATS server's certificate is checked against (TLS)")
    nats_tls_cert_file: Path | None = Field(None, description="client certificate for mutual TLS to NATS (with the key file)")
    nats_tls_key_file: Path | None = Field(None, description="client private key for mutual TLS to NATS")
    nats_connect_timeout_s: float = Field(30.0, gt=0, description="give up on the first connection after this long")
    stream_max_age_s: float = Field(7 * 24 * 3600, gt=0, description="how long the event stream keeps events")
    duplicate_window_s: float = Field(120.0, gt=0, description="JetStream de-duplication window for Nats-Msg-Id")
    max_deliver: int = Field(5, ge=1, description="deliveries before a failing message goes to the dead-letter subject")
    ack_wait_s: float = Field(30.0, gt=0, description="redeliver a message not acked within this long")
    backoff_base_s: float = Field(0.5, gt=0, description="first retry delay; doubles per delivery")
    backoff_max_s: float = Field(30.0, gt=0, description="cap of the retry delay")
    fetch_batch: int = Field(64, ge=1, le=1024, description="messages fetched per pull")
    request_timeout_s: float = Field(5.0, gt=0, description="request/reply timeout")
    jetstream_timeout_s: float = Field(5.0, gt=0, description="a JetStream or KV call gives up after this long (e.g. while NATS is away)")
    nats_replicas: int = Field(1, ge=1, le=5, description="replicas of the stream and KV buckets: 1 on one server, 3 on a three-node JetStream cluster")
    nats_ping_interval_s: float = Field(5.0, gt=0, description="ping the server this often; two unanswered pings (a paused or partitioned server) mean reconnect to another")
    publish_retry_s: float = Field(30.0, gt=0, description="a publish keeps retrying (same Nats-Msg-Id) through a leader election or outage this long")
    nats_election_wait_s: float = Field(20.0, ge=0, description="a JetStream or KV call that finds no stream or bucket leader (one being elected after a server was lost) asks again until this long; 0 = fail at once")

    def urls(self) -> list[str]:
        return nats_servers(self.nats_url) if self.nats_url else []


def nats_servers(url: str) -> list[str]:
    """The servers in a NATS URL setting: one URL or several, comma separated (a cluster's seeds)."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ConfigError(f"expected one or more NATS URLs, comma separated (nats://a:4222,nats://b:4222), got {url!r}")
    return servers


class ProbeSettings(_Settings):
    """The HTTP endpoint for /healthz, /readyz and /metrics."""

    probe_listen: str = Field("0.0.0.0:8081", description="HOST:PORT for /healthz, /readyz, /metrics (port 0 = any)")


class LogSettings(_Settings):
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="the least severe level logged")
    log_json: bool = Field(False, description="one JSON object per line instead of key=value text")


S = TypeVar("S", bound=BaseSettings)


def load(cls: type[S], args: argparse.Namespace | None = None) -> S:
    """Build settings from env, then let any flag the user actually gave win."""
    overrides = {}
    if args is not None:
        overrides = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    try:
        return cls(**overrides)
    except ValidationError as error:
        problems = "; ".join(f"{ENV_PREFIX}{'.'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"invalid {cls.__name__}: {problems}") from None


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(value: str) -> float:
    """Seconds for `90`, `90s`, `10m`, `2h`, `1d`, `250ms`; ConfigError otherwise."""
    match = _DURATION.match(value)
    if not match:
        raise ConfigError(f"expected a duration like 30s, 10m or 2h, got {value!r}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def split_host_port(listen: str) -> tuple[str, int]:
    """Parse HOST:PORT (IPv6 in brackets) into its parts, with a clear error."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)
