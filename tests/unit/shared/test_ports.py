"""Ports for local servers: free on every address, never one the kernel may hand to an outgoing connection, never the
same twice in one process."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kai_isolator.shared import ports


def test_a_port_is_outside_the_ephemeral_range_and_free_on_every_address() -> None:
    low, high = (int(field) for field in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = ports.free_port()
        assert ports.LOWEST <= port <= 65535 and not low <= port <= high
        with socket.socket() as server:
            server.bind(("0.0.0.0", port))


def test_a_port_held_on_loopback_alone_is_not_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server bound to 127.0.0.1 only still takes the port from one that binds every address (KAI's `:PORT`)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        monkeypatch.setattr(ports, "_pool", lambda: [taken])
        with pytest.raises(OSError, match="no free port"):
            ports.free_port()


def test_one_process_never_names_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_pool", lambda: [ports.LOWEST, ports.LOWEST + 1])
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports, "_bindable", lambda port: True)
    assert sorted([ports.free_port(), ports.free_port()]) == [ports.LOWEST, ports.LOWEST + 1]
    with pytest.raises(OSError, match="no free port"):
        ports.free_port()


def test_without_the_kernels_range_linuxs_default_is_kept_clear(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert not any(32768 <= port <= 60999 for port in ports._pool())
