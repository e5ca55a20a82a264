"""The embedded nats-server and cluster used by `make run` and the tests: a failed start says why, and a port that
another process took between the probe and the bind costs fresh ports, not the start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kai_isolator.shared.embedded_nats import EmbeddedCluster, EmbeddedNats, PortTaken


def _occupy(port: int) -> socket.socket:
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


def test_a_server_whose_port_is_taken_says_so_with_its_log(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "store")
    with _occupy(server.port), pytest.raises(PortTaken) as failure:
        server.start(timeout_s=20)
    assert f"port {server.port}" in str(failure.value) and "address already in use" in str(failure.value)
    assert server.log_file.exists()


def test_a_cluster_that_loses_a_port_race_starts_on_fresh_ports(tmp_path: Path) -> None:
    cluster = EmbeddedCluster(tmp_path / "cluster")
    taken = cluster.members[1].cluster_port
    with _occupy(taken):
        cluster.start()
        try:
            assert taken not in {m.cluster_port for m in cluster.members}
            assert all(m.pid is not None for m in cluster.members)
            first = cluster.members[0]
            first.kill()
            first.start()  # a member restarts on its own (new) ports and store, as the fault tests need
        finally:
            cluster.stop()


def test_a_cluster_that_cannot_start_leaves_no_server_running(tmp_path: Path) -> None:
    """A member that cannot start (its store is a file, not a folder) fails the start, and the members that did
    start are stopped with it instead of outliving the test (they once did, and held their ports for hours)."""
    cluster = EmbeddedCluster(tmp_path / "cluster")
    cluster.members[2].store_dir.parent.mkdir(parents=True, exist_ok=True)
    cluster.members[2].store_dir.write_text("not a store")
    with pytest.raises(FileExistsError):
        cluster.start(timeout_s=10)
    assert [m.pid for m in cluster.members] == [None, None, None]
