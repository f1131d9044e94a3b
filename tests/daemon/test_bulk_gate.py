"""The bulk port's front door (bulk_gate.py; issue 30 finding 8), in process on 127.0.0.1: idle
connections without a ticket hold no transfer thread, are capped per source and time out; the
port's health. Connections stay on loopback and are bounded in count and time."""

from __future__ import annotations

import socket
import time
from typing import Iterator

import pytest

from ckptd.daemon.tiers import bulk_gate
from ckptd.daemon.tiers.bulk import BulkServer, connect, recv_status, send_status

IDLE = 200


@pytest.fixture
def server() -> Iterator[BulkServer]:
    bulk = BulkServer("127.0.0.1", 0)
    bulk.start()
    yield bulk
    bulk.close()


def _idle(port: int, count: int) -> list[socket.socket]:
    """`count` connections that never send a byte."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _echo_transfer(server: BulkServer) -> float:
    """A real ticketed transfer (1 KiB in, a status back); its seconds."""
    def take(sock: socket.socket) -> None:
        got = b""
        while len(got) < 1024:
            got += sock.recv(1024 - len(got))
        send_status(sock, got == b"x" * 1024)

    started = time.monotonic()
    ticket = server.issue(take)
    with connect("127.0.0.1", server.port, ticket, None, timeout_s=30) as sock:
        sock.sendall(b"x" * 1024)
        assert recv_status(sock) == (True, "")
    return time.monotonic() - started


# issue 30 finding 8
def test_two_hundred_idle_connections_do_not_keep_a_real_transfer_waiting(server: BulkServer) -> None:
    idle = _idle(server.port, IDLE)
    try:
        assert _echo_transfer(server) < 2.0  # at once: the idle ones hold no transfer thread
        assert _echo_transfer(server) < 2.0
    finally:
        for sock in idle:
            sock.close()


# issue 30 finding 8
def test_connections_without_a_ticket_are_capped_per_source_oldest_first(server: BulkServer) -> None:
    idle = _idle(server.port, 40)
    try:
        deadline = time.monotonic() + 5
        while sum(_closed_by_peer(s) for s in idle) < 40 - bulk_gate.MAX_OPENING_PER_SOURCE:
            assert time.monotonic() < deadline, "over the per-source cap, connections were not closed"
            time.sleep(0.05)
        closed = [i for i, s in enumerate(idle) if _closed_by_peer(s)]
        assert closed == list(range(40 - bulk_gate.MAX_OPENING_PER_SOURCE))  # the oldest went first
        status = server.status()
        assert status.healthy and status.refused >= 24 and status.opening <= bulk_gate.MAX_OPENING_PER_SOURCE
    finally:
        for sock in idle:
            sock.close()


# issue 30 finding 8
def test_a_connection_that_presents_no_ticket_in_time_is_closed(server: BulkServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk_gate, "OPENING_TIMEOUT_S", 0.3)
    (late,) = _idle(server.port, 1)
    try:
        late.sendall(b"CKB1")  # half an opening, then nothing
        deadline = time.monotonic() + 5
        while not _closed_by_peer(late):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        late.close()
    assert _echo_transfer(server) < 2.0


# issue 30 finding 8
def test_the_port_reports_a_failed_accept_for_a_while_then_healthy_again(server: BulkServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    health = server._gate.health  # type: ignore[union-attr]
    assert server.status().healthy and server.status().problem == ""
    health.accept_failed(OSError(errno.EMFILE, "Too many open files"))
    status = server.status()
    assert not status.healthy and "Too many open files" in status.problem and "LimitNOFILE" in status.problem and status.accept_errors == 1
    monkeypatch.setattr(bulk_gate, "HEALTH_WINDOW_S", 0.0)
    health.tick(0)
    assert server.status().healthy
