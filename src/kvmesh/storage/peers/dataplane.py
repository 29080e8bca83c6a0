"""The P2P data plane's serving side: leased chunks sent from L1 memory over TCP.

A peer that locked a prefix here (``LockPrefix``, gRPC) connects to the data
port named in the answer and sends the lease id; this node writes the
lease's chunks to the socket straight from their L1 memory (wire format:
:mod:`kvmesh.storage.peers.tcp_stream`). gRPC's ReadChunks moves the same
bytes at less than half the speed of a plain socket on loopback (protobuf
framing, and copies into and out of gRPC's buffers on both sides); this path
costs what the socket costs (``kvmesh bench p2p``).

Threads: accepting a connection and reading its request happen on the event
loop (a request must arrive within 5 s). The send itself is a blocking
``sendall`` on a thread of ``kvmesh-p2p-send`` (at most ``max_streams``, one
per stream, started on first use; ``p2p_max_streams``), so neither a large
chunk nor a slow reader ever holds the loop. The lease is opened and closed on the loop
(:meth:`PeerLeases.open_stream` / ``close_stream``); the sender stops reading
L1 memory by the lease's deadline, which its socket timeout enforces, so a
reader that stops reading costs one thread until the lease's TTL, never a
lock past it (a reader that never reads holds its thread until the lease's
TTL, which the asker chose, up to 0.8 of the L1 read TTL). Connections beyond
``max_connections`` (waiting for their request, or streaming), and streams
beyond ``max_streams``, are refused with RESOURCE_EXHAUSTED; the asker then
reads the same lease over ReadChunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvmesh.common.config import ConfigError
from kvmesh.common.errors import KvmeshError
from kvmesh.storage.core.peer.leases import ChunkStream, PeerLeases
from kvmesh.storage.peers import tcp_stream as wire

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
#: Largest piece of one ``sendall``: the sender checks the deadline between pieces.
SEND_PIECE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_STREAMS = 8
DEFAULT_MAX_CONNECTIONS = 64
#: What a refused connection may still send before it is closed.
DRAIN_BYTES = 64 * 1024


class PeerDataPlane:
    """The TCP listener of one storage node's data plane."""

    def __init__(
        self,
        leases: PeerLeases,
        host: str,
        port: int,
        *,
        max_streams: int = DEFAULT_MAX_STREAMS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.leases = leases
        self.host = host
        self.requested_port = port
        self.max_streams = max_streams
        self.max_connections = max_connections
        self.port = 0
        self.streams = 0  # served since start
        self.refused = 0  # connections refused: a bad request, a busy node, a lease not found
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._connections: set[socket.socket] = set()
        self._streaming = 0
        self._stop = threading.Event()
        self._senders = ThreadPoolExecutor(
            max_workers=max_streams, thread_name_prefix="kvmesh-p2p-send"
        )

    async def start(self) -> int:
        """Bind and start accepting; the bound port."""
        host = self.host or None  # '' listens on every address, like gRPC's '[::]'
        family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
        if host in ("::", None):
            family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        try:
            self._sock = socket.create_server(
                (host or "", self.requested_port),
                family=family,
                backlog=64,
                dualstack_ipv6=family == socket.AF_INET6 and host in ("::", None),
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot listen for P2P data on {host or '*'}:{self.requested_port} "
                f"(p2p_data_port): {exc.strerror or exc}"
            ) from None
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept_loop(), name="kvmesh-p2p-accept")
        return self.port

    async def close(self) -> None:
        """Stop accepting, break every running stream, wait for its sender. Idempotent."""
        self._stop.set()
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for conn in list(self._connections):
            _shut(conn)
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        for conn in list(self._connections):  # accepted, but their task never ran
            conn.close()
        self._connections.clear()
        self._senders.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        """Counters of the data plane."""
        return {"data_streams": self.streams, "data_refused": self.refused}

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                logger.warning("P2P data plane: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            self._connections.add(conn)  # closed by close() even if its task never starts
            task = asyncio.create_task(self._serve(conn), name="kvmesh-p2p-stream")
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            if len(self._connections) > self.max_connections:
                await self._refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many connections")
                return
            try:
                lease_id = await asyncio.wait_for(_read_request(conn), REQUEST_TIMEOUT_S)
            except (TimeoutError, ValueError, OSError) as exc:
                why = "no request within 5 s" if isinstance(exc, TimeoutError) else str(exc)
                await self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, why)
                return
            if self._streaming >= self.max_streams:
                await self._refuse(
                    conn,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this node serves {self.max_streams} streams at once",
                )
                return
            try:
                stream = self.leases.open_stream(lease_id)
            except KvmeshError as exc:
                await self._refuse(conn, grpc.StatusCode[exc.code], exc.message)
                return
            await self._stream(conn, stream)
        finally:
            self._connections.discard(conn)
            conn.close()

    async def _stream(self, conn: socket.socket, stream: ChunkStream) -> None:
        """Send on a sender thread; hand the memory back only once that thread is done.

        Cancelled (shutdown), the socket is shut so the sender stops at its next
        send, and the release still waits for it, however often the wait itself
        is cancelled: the locks never go while the thread may read the memory.
        """
        loop = asyncio.get_running_loop()
        sent = (0, 0)
        cancelled = False
        self._streaming += 1
        self.streams += 1
        try:
            future = loop.run_in_executor(self._senders, self._send, conn, stream)
            while True:
                try:
                    sent = await asyncio.shield(future)
                    break
                except asyncio.CancelledError:
                    cancelled = True
                    _shut(conn)
                    if future.done():
                        if not future.cancelled() and future.exception() is None:
                            sent = future.result()
                        break
        finally:
            self._streaming -= 1
            self.leases.close_stream(stream, *sent)
        if cancelled:
            raise asyncio.CancelledError

    def _send(self, conn: socket.socket, stream: ChunkStream) -> tuple[int, int]:
        """On a sender thread: every chunk, then the end record; (chunks, bytes) sent whole."""
        chunks = nbytes = 0
        conn.setblocking(True)
        try:
            for index, view in enumerate(stream.views):
                pieces = [memoryview(wire.chunk_header(index, len(view)))]
                pieces += [
                    view[o : o + SEND_PIECE_BYTES] for o in range(0, len(view), SEND_PIECE_BYTES)
                ]
                for piece in pieces:
                    left = stream.deadline - time.monotonic()
                    if left <= 0 or self._stop.is_set():
                        return chunks, nbytes  # the lease's time is up: close, never read past it
                    conn.settimeout(left)
                    conn.sendall(piece)
                chunks += 1
                nbytes += len(view)
            conn.settimeout(max(0.001, min(2.0, stream.deadline - time.monotonic())))
            conn.sendall(wire.end_record(grpc.StatusCode.OK))
        except OSError as exc:  # the reader went away, stopped reading, or the node closes
            logger.info("P2P data plane: stream of %s ended early: %s", stream.lease_id, exc)
        return chunks, nbytes

    async def _refuse(self, conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        self.refused += 1
        logger.info("P2P data plane: refused a stream: %s: %s", code.name, message)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(loop.sock_sendall(conn, wire.end_record(code, message)), 2.0)
            # Closing with unread request bytes would reset the connection and could
            # destroy the end record before the peer reads it: finish sending, then
            # drain what the peer still sends (a little, briefly).
            conn.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(_drain(conn, DRAIN_BYTES), 1.0)


async def _read_request(conn: socket.socket) -> str:
    """The lease id of a connection's request (ValueError: malformed)."""
    head = await _recv_exact(conn, wire.REQUEST.size)
    magic, version, size = wire.REQUEST.unpack(head)
    if magic != wire.REQUEST_MAGIC:
        raise ValueError(f"not a kvmesh P2P data request (magic {magic!r})")
    if version != wire.VERSION:
        raise ValueError(f"protocol version {version} is not {wire.VERSION}")
    if not 0 < size <= wire.MAX_LEASE_ID_BYTES:
        raise ValueError(f"a lease id is 1 to {wire.MAX_LEASE_ID_BYTES} bytes, not {size}")
    raw = await _recv_exact(conn, size)
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("the lease id is not ASCII") from None


async def _drain(conn: socket.socket, limit: int) -> None:
    loop = asyncio.get_running_loop()
    while limit > 0:
        part = await loop.sock_recv(conn, min(limit, 65536))
        if not part:
            return
        limit -= len(part)


async def _recv_exact(conn: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        part = await loop.sock_recv(conn, n - len(buf))
        if not part:
            raise ValueError("the connection closed before its request was complete")
        buf += part
    return bytes(buf)


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
