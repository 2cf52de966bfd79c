"""blockfs.serve.control.announce (and the listener under it): announcements in-process, and a hostile neighbour.

"Another user" is a forked child that drops to uid 65534 (needs root; skipped otherwise).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading

import pytest
from polling import wait_until

from blockfs import protocol
from blockfs.serve.control.announce import MAX_CONNECTIONS, PrefetchListener

NOBODY = 65534


@pytest.fixture
def listener():
    got: queue.Queue[list[int]] = queue.Queue()
    server = PrefetchListener(got.put, n_blocks=100)
    yield server, got
    server.close()


def send(address: bytes, payload: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(address)
        s.sendall(payload)


def knock(address: bytes, payload: bytes) -> None:
    """Connect and send as a refused user does: the mount closing the connection is expected."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(address)
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass


def as_another_user(action) -> int:
    """Run ``action()`` in a child process of user nobody; its exit status (0: it returned)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    child = os.fork()
    if child == 0:
        status = 1
        try:
            os.setuid(NOBODY)
            action()
            status = 0
        finally:
            os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def test_an_announcement_reaches_the_cache_in_order(listener):
    server, got = listener
    assert server.address.startswith(protocol.PREFETCH_SOCKET_PREFIX)
    send(server.address, protocol.encode_announcement([5, 2, 7, 500, 0]))
    assert got.get(timeout=10) == [5, 2, 7, 0]  # out of range left out


def test_a_malformed_announcement_is_dropped_with_a_log_line(listener, caplog):
    server, got = listener
    with caplog.at_level(logging.WARNING):
        send(server.address, b"5\nnot a block\n")
        send(server.address, b"3\n")
        assert got.get(timeout=10) == [3]
    assert got.empty()
    assert any("prefetch announcement dropped" in r.getMessage() for r in caplog.records)


def test_an_idle_connection_does_not_delay_another_clients_announcement(listener):
    server, got = listener
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as halfway,
    ):
        idle.connect(server.address)
        halfway.connect(server.address)
        halfway.sendall(b"1\n2")  # an announcement in progress, never finished while the other is sent
        send(server.address, b"9\n8\n")
        # The old server read one connection at a time with a 5 s timeout: this waited for it.
        assert got.get(timeout=2) == [9, 8]
        halfway.sendall(b"\n3\n")
    assert got.get(timeout=10) == [1, 2, 3]  # each connection has its own buffer


def test_open_connections_are_bounded_and_the_longest_idle_goes(listener):
    server, got = listener
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.address)
            socks.append(s)
        wait_until(lambda: server.open_connections() == MAX_CONNECTIONS, "server.open_connections() == MAX_CONNECTIONS")
        socks[0].settimeout(10)
        assert socks[0].recv(1) == b""  # the first, idle longest, was closed by the mount
        socks[-1].sendall(b"4\n")
        socks[-1].close()
        assert got.get(timeout=10) == [4]
    finally:
        for s in socks:
            s.close()


def test_many_refused_connections_write_a_bounded_number_of_log_lines(listener, caplog):
    server, got = listener
    n = 2000

    def flood() -> None:
        for _ in range(n):
            knock(server.address, b"0\n1\n")

    with caplog.at_level(logging.WARNING):
        assert as_another_user(flood) == 0
        wait_until(lambda: server.refusals.refused == n, "server.refusals.refused == n")
        refused = [r for r in caplog.records if "refused" in r.getMessage()]
        assert 1 <= len(refused) <= 2  # the first, and at most one more per interval (10 s)
        assert f"user {NOBODY}" in refused[0].getMessage()
        server.refusals.interval_s = 0.0  # the next line says how many were not logged
        assert as_another_user(lambda: knock(server.address, b"2\n")) == 0
        wait_until(lambda: server.refusals.refused == n + 1, "server.refusals.refused == n + 1")
    last = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()][-1]
    assert "more refused since the last such line" in last
    assert got.empty()  # nothing another user sent reached the cache
    send(server.address, b"6\n")  # and the mount's own user is still heard
    assert got.get(timeout=10) == [6]


def test_the_listener_is_one_thread_however_many_clients(listener):
    server, got = listener
    before = threading.active_count()
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.address)
            socks.append(s)
        wait_until(lambda: server.open_connections() == MAX_CONNECTIONS, "server.open_connections() == MAX_CONNECTIONS")
        assert threading.active_count() == before
    finally:
        for s in socks:
            s.close()
