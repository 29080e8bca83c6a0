"""The lane client's socket calls (src/kvmesh/rpc/lane/gilsocket.py), over socket pairs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvmesh.rpc.lane.gilsocket import recv_some, send_now


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_send_now_sends_what_fits_and_nothing_once_the_buffer_is_full(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    assert send_now(a.fileno(), b"hello") == 5
    assert b.recv(16) == b"hello"
    a.setblocking(False)
    filled = 0
    while True:  # fill the socket's buffer
        try:
            filled += a.send(b"x" * 65536)
        except BlockingIOError:
            break
    assert filled > 0
    assert send_now(a.fileno(), b"more") == 0  # never blocks


def test_send_now_to_a_closed_peer_raises_oserror(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.close()
    with pytest.raises(BrokenPipeError):
        send_now(a.fileno(), b"hello")  # EPIPE, without a SIGPIPE


def test_recv_some_reads_what_arrived_into_the_offset(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(b"abc")
    buffer = bytearray(b"..........")
    assert recv_some(b.fileno(), buffer, 4, None) == 3
    assert bytes(buffer) == b"....abc..."


def test_recv_some_is_zero_when_the_peer_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.close()
    assert recv_some(b.fileno(), bytearray(8), 0, time.monotonic() + 5.0, spin_s=0.01) == 0


def test_recv_some_times_out_at_the_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    with pytest.raises(TimeoutError):
        recv_some(b.fileno(), bytearray(8), 0, time.monotonic() + 0.05)
    with pytest.raises(TimeoutError):  # a spin longer than the deadline ends at it too
        recv_some(b.fileno(), bytearray(8), 0, time.monotonic() + 0.05, spin_s=10.0)


@pytest.mark.parametrize("spin_s", [0.0, 0.005, 5.0])
def test_an_answer_that_comes_later_is_read_with_or_without_a_spin(
    pair: tuple[socket.socket, socket.socket], spin_s: float
) -> None:
    a, b = pair
    timer = threading.Timer(0.1, a.sendall, args=(b"late",))
    timer.start()
    try:
        buffer = bytearray(8)
        got = recv_some(b.fileno(), buffer, 0, time.monotonic() + 10.0, spin_s=spin_s)
    finally:
        timer.join()
    assert bytes(buffer[:got]) == b"late"


def test_recv_some_on_a_socket_that_is_not_connected_raises_oserror() -> None:
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lonely,
        pytest.raises(OSError, match="recv"),
    ):
        recv_some(lonely.fileno(), bytearray(8), 0, time.monotonic() + 1.0, spin_s=0.01)
