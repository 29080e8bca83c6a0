"""What the P2P core needs from the outside: the directory and a link to peers.

Plain protocols and values; :mod:`kvmesh.storage.peers` implements them over
gRPC (the coordinator's DirectoryService and MembershipService, and the
peers' PeerService). Every call takes a timeout and raises
:class:`PeerUnavailable` (never anything else) when it cannot answer in time
or the other side refuses: the directory is a hint, so every failure ends
as a miss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.common.keys import ObjectKey

#: The transport of P2P bytes on this build (NIXL's backends cannot run here).
TRANSPORT = "grpc-stream"


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


class PeerDirectory(Protocol):
    """The coordinator's view of who holds what."""

    def holders(self, keys: Sequence[ObjectKey], timeout: float) -> list[frozenset[str]]:
        """Per key, the instances holding it in L1 or in a private L2."""
        ...

    def peers(self, timeout: float) -> dict[str, PeerTarget]:
        """Live instances that advertised a storage address, by instance id."""
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

    def read(
        self, peer: PeerTarget, lease_id: str, frame_bytes: int, timeout: float
    ) -> Iterator[tuple[int, int, memoryview]]:
        """The lease's frames as ``(chunk_index, offset, data)``; ends the lease when done."""
        ...

    def unlock(self, peer: PeerTarget, lease_id: str, timeout: float) -> None:
        """Release a lease (idempotent)."""
        ...

    def close(self) -> None:
        """Cancel running reads and close every connection."""
        ...
