"""Socket calls for the blocking lane client that give up the GIL once per wait.

Python's own ``socket.sendall`` and ``socket.recv`` release the GIL around
every system call, and with a timeout set they also ``poll()`` first: a
call releases and re-takes the GIL four times or more. Each release lets
another thread of the process run Python code, and the caller waits until
that thread gives the GIL back. Inside vLLM's engine-core process, whose
own threads send and receive every step's messages, that made a lookup's
request leave 1–4 ms after the connector asked (docs/performance.md,
"The engine's threads and the GIL").

Here the send and the read of an answer that has arrived run with the GIL
held (``MSG_DONTWAIT``: they never block), and only the wait for the answer,
``poll()``, releases it: one hand-off per call, while the node works. The
functions raise ``OSError`` as the socket module does, and ``TimeoutError``
when the deadline passes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import time

__all__ = ["recv_some", "send_now"]

_MSG_DONTWAIT = socket.MSG_DONTWAIT
_MSG_NOSIGNAL = socket.MSG_NOSIGNAL
_POLLIN = 0x001


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


# PyDLL keeps the GIL during the call; CDLL releases it (ctypes' documented behaviour).
_held = ctypes.PyDLL(None, use_errno=True)
_released = ctypes.CDLL(None, use_errno=True)

_send = _held.send
_send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
_send.restype = ctypes.c_ssize_t

_recv = _held.recv
_recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_recv.restype = ctypes.c_ssize_t

_poll = _released.poll
_poll.argtypes = [ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.c_int]
_poll.restype = ctypes.c_int

_yield = _held.sched_yield
_yield.argtypes = []
_yield.restype = ctypes.c_int


def _raise_errno(what: str) -> None:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


def send_now(fd: int, data: bytes) -> int:
    """Send as much of ``data`` as the socket takes without waiting; the count sent.

    Keeps the GIL: the request leaves before any other thread runs. 0 when
    the socket's buffer is full (the caller sends the rest the usual way).
    """
    while True:
        sent = _send(fd, data, len(data), _MSG_DONTWAIT | _MSG_NOSIGNAL)
        if sent >= 0:
            return int(sent)
        code = ctypes.get_errno()
        if code == errno.EINTR:
            continue
        if code in (errno.EAGAIN, errno.EWOULDBLOCK):
            return 0
        _raise_errno("send")


def recv_some(
    fd: int, buffer: bytearray, offset: int, deadline: float | None, spin_s: float = 0.0
) -> int:
    """Wait for data (GIL released), then read what arrived into ``buffer[offset:]`` (GIL held).

    Returns the count read, 0 when the peer closed the connection. Raises
    TimeoutError once ``deadline`` (``time.monotonic()``) passes. With
    ``spin_s``, first polls that long without releasing the GIL (yielding
    the core between tries), for an answer expected within it.
    """
    room = len(buffer) - offset
    view = (ctypes.c_char * room).from_buffer(buffer, offset)
    pollfd = _PollFd(fd, _POLLIN, 0)
    # The spin is Python code: the interpreter still hands the GIL over to a thread
    # that has waited a switch interval for it (5 ms by default, longer than any spin).
    spin_until = time.monotonic() + spin_s if spin_s > 0 else 0.0
    while True:
        got = _recv(fd, view, room, _MSG_DONTWAIT)
        if got >= 0:
            return int(got)
        code = ctypes.get_errno()
        if code == errno.EINTR:
            continue
        if code not in (errno.EAGAIN, errno.EWOULDBLOCK):
            _raise_errno("recv")
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise TimeoutError("timed out")
        if now < spin_until:
            _yield()
            continue
        wait_ms = -1 if deadline is None else max(1, int((deadline - now) * 1000.0 + 0.999))
        if _poll(ctypes.byref(pollfd), 1, wait_ms) < 0 and ctypes.get_errno() != errno.EINTR:
            _raise_errno("poll")
