"""What the P2P core needs from the outside: the directory and a link to peers.

Plain protocols and values; :mod:`kvmesh.storage.peers` implements them over
gRPC (the coordinator's DirectoryService and MembershipService, and the
peers' PeerService). Every call takes a timeout and raises
:class:`PeerUnavailable` (never anything else) when it cannot answer in time
or the other side refuses: the directory is a hint, so every failure ends
as a miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.common.keys import ObjectKey

#: The transports of P2P bytes (NIXL's backends cannot run here): the data plane's
#: plain TCP stream, and the PeerService's ReadChunks (for a peer with no data port).
TCP_STREAM = "tcp-stream"
GRPC_STREAM = "grpc-stream"


class PeerUnavailable(Exception):
    """A directory or peer call failed, timed out, or answered something unusable."""


@dataclass(frozen=True, slots=True)
class PeerTarget:
    """A live storage node that peers can dial."""

    instance_id: str
    address: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class PeerLease:
    """A prefix read-locked on a peer: ``locked_chunks`` columns, sizes column-major."""

    lease_id: str
    locked_chunks: int
    chunk_sizes: tuple[int, ...]
    #: The peer's TCP data port (0: it offers none, read over ReadChunks).
    data_port: int = 0


class FrameSink(Protocol):
    """Where a link writes the bytes it receives (the fetcher's staged objects).

    A link asks :meth:`place` for the memory of each piece of a chunk before it
    reads the piece, writes exactly there, then reports it with :meth:`wrote`,
    so a transport that can receive into memory (TCP's ``recv_into``) does.
    """

    def place(self, index: int, offset: int, nbytes: int) -> memoryview | None:
        """Memory for bytes ``[offset, offset + nbytes)`` of chunk ``index``.

        None: stop the stream here (a piece out of order or too large, a chunk
        not needed, or this node is closing); the link then ends it.
        """
        ...

    def wrote(self, index: int, nbytes: int) -> None:
        """``nbytes`` more bytes of chunk ``index`` are in place."""
        ...


class PeerDirectory(Protocol):
    """The coordinator's view of who holds what."""

    def holders(self, keys: Sequence[ObjectKey], timeout: float) -> list[frozenset[str]]:
        """Per key, the instances holding it in L1 or in a private L2."""
        ...

    def peers(self, timeout: float) -> dict[str, PeerTarget]:
        """Live instances that advertised a storage address, by instance id."""
        ...

    def cached_peers(self) -> dict[str, PeerTarget] | None:
        """What :meth:`peers` would answer now from its cache; None when it would ask.

        Never calls the coordinator: for callers that must not block.
        """
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class PeerLink(Protocol):
    """Calls to other nodes' PeerService."""

    def lock(
        self,
        peer: PeerTarget,
        rows: Sequence[Sequence[ObjectKey]],
        ttl_s: float,
        timeout: float,
    ) -> PeerLease:
        """Read-lock the longest prefix of ``rows``'s columns the peer holds."""
        ...

    def read(self, peer: PeerTarget, lease: PeerLease, sink: FrameSink, timeout: float) -> bool:
        """Receive the lease's chunks into ``sink``; the peer ends the lease with the stream.

        True when the stream ended normally (every chunk sent); False when the
        sink stopped it. Raises PeerUnavailable when it broke or timed out.
        """
        ...

    def unlock(self, peer: PeerTarget, lease_id: str, timeout: float) -> None:
        """Release a lease (idempotent)."""
        ...

    def close(self) -> None:
        """Cancel running reads and close every connection."""
        ...


def deliver(frames: Iterable[tuple[int, int, memoryview | bytes]], sink: FrameSink) -> bool:
    """Copy ``(chunk_index, offset, data)`` frames into ``sink``; False when it stopped them.

    For a transport that hands out its frames as buffers (gRPC's ReadChunks).
    """
    for index, offset, data in frames:
        view = sink.place(index, offset, len(data))
        if view is None:
            return False
        view[:] = data
        sink.wrote(index, len(data))
    return True
