"""Settings come from env with flags on top; bad values fail clearly; logs are one line each."""

from __future__ import annotations

import argparse
import json
import logging
from datetime import datetime, timedelta, timezone

import pytest

from kai_isolator.shared import logs
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.settings import BusSettings, LogSettings, load, split_host_port
from kai_isolator.shared.tail import parse_since


def test_env_sets_and_flags_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAI_ISOLATOR_NATS_URL", "nats://env:4222")
    monkeypatch.setenv("KAI_ISOLATOR_MAX_DELIVER", "7")
    assert load(BusSettings).nats_url == "nats://env:4222"
    flags = argparse.Namespace(nats_url="nats://flag:4222", max_deliver=None, unrelated="x")
    settings = load(BusSettings, flags)
    assert settings.nats_url == "nats://flag:4222" and settings.max_deliver == 7


@pytest.mark.parametrize("name, value", [("KAI_ISOLATOR_MAX_DELIVER", "many"), ("KAI_ISOLATOR_ACK_WAIT_S", "-1"), ("KAI_ISOLATOR_LOG_LEVEL", "loud")])
def test_garbage_env_values_fail_with_the_variable_named(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        load(LogSettings if "LOG" in name else BusSettings)


@pytest.mark.parametrize("listen, expected", [("0.0.0.0:8443", ("0.0.0.0", 8443)), (":80", ("0.0.0.0", 80)), ("[::1]:9", ("::1", 9))])
def test_host_port_parsing(listen: str, expected: tuple[str, int]) -> None:
    assert split_host_port(listen) == expected


@pytest.mark.parametrize("bad", ["8443", "host:", "host:http", "h:70000"])
def test_bad_host_port_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        split_host_port(bad)


def test_since_accepts_durations_and_instants() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    assert parse_since("10m", now) == now - timedelta(minutes=10)
    assert parse_since(" 1.5h ", now) == now - timedelta(minutes=90)
    assert parse_since("2026-11-30T11:00:00", now) == datetime(2026, 11, 30, 11, tzinfo=timezone.utc)
    with pytest.raises(ConfigError, match="--since"):
        parse_since("yesterday", now)


def test_json_logs_are_one_object_per_line_with_fields(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(LogSettings(log_json=True))
    logging.getLogger("kai.test").info("pod injected", extra={"pod": "team-a/p1", "patch_ops": 7})
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    record = json.loads(line)
    assert record["msg"] == "pod injected" and record["pod"] == "team-a/p1" and record["patch_ops"] == 7
    assert record["level"] == "info" and record["logger"] == "kai.test"


def test_text_logs_carry_fields_as_key_value(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(LogSettings())
    logging.getLogger("kai.test").warning("retrying", extra={"delay_s": 0.5})
    assert capsys.readouterr().err.rstrip().endswith("warning kai.test: retrying delay_s=0.5")
