"""One P2P fetch's staged objects, and the sink that checks every piece a peer sends.

Used by :class:`~kvmesh.storage.core.peer.fetch.PeerFetcher`: it stages one L1
object per chunk in a :class:`Transfer`, and the link writes the peer's
frames through a :class:`TransferSink`, which refuses anything out of order
or beyond the announced sizes before a byte is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.objects import L1Object
from kvmesh.storage.core.peer.ports import PeerTarget

logger = logging.getLogger(__name__)

Cell = tuple[int, int]  # (row, column)


@dataclass(eq=False)
class Transfer:
    """One fetch's staged objects and bytes received."""

    rows: list[list[ObjectKey]]
    sizes: list[int]  # column-major, per locked cell
    tag: str
    staged: dict[Cell, L1Object] = field(default_factory=dict)
    local: set[Cell] = field(default_factory=set)
    received: list[int] = field(default_factory=list)
    complete: bool = False  # the stream ended normally (the peer ended the lease)
    error: Exception | None = None  # why the stream broke, when it did
    problem: str = ""  # what cut the prefix short, for the span

    @property
    def height(self) -> int:
        return len(self.rows)

    def cell(self, index: int) -> Cell:
        return index % self.height, index // self.height

    def key(self, cell: Cell) -> ObjectKey:
        return self.rows[cell[0]][cell[1]]


class TransferSink:
    """A transfer's staged objects as the link's FrameSink: every piece checked first.

    A piece must continue its chunk (in order, within the size the peer
    announced); chunks beyond what this node could stage stop the stream, and
    chunks that were already resident here are read into a scratch buffer and
    dropped.
    """

    def __init__(
        self,
        peer: PeerTarget,
        t: Transfer,
        limit: int,
        *,
        closing: Callable[[], bool],
        on_received: Callable[[int], None],
    ) -> None:
        self.closing = closing
        self.on_received = on_received
        self.peer = peer
        self.t = t
        self.limit = limit
        self._scratch = bytearray()

    def place(self, index: int, offset: int, nbytes: int) -> memoryview | None:
        t = self.t
        if self.closing():
            t.problem = "this node is closing"
            return None
        if not 0 <= index < len(t.sizes) or offset != t.received[index]:
            logger.warning("P2P: %s sent frame %d@%d out of order", self.peer, index, offset)
            t.problem = f"frame {index}@{offset} out of order"
            return None
        if offset + nbytes > t.sizes[index]:
            logger.warning("P2P: %s sent more bytes than chunk %d holds", self.peer, index)
            t.problem = f"more bytes than chunk {index} holds"
            return None
        if index >= self.limit:
            return None  # beyond what this node could stage: the rest is not needed
        obj = t.staged.get(t.cell(index))
        if obj is not None:
            return obj.view()[offset : offset + nbytes]
        if len(self._scratch) < nbytes:
            self._scratch = bytearray(nbytes)
        return memoryview(self._scratch)[:nbytes]

    def wrote(self, index: int, nbytes: int) -> None:
        self.t.received[index] += nbytes
        self.on_received(nbytes)
