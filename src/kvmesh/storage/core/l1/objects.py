"""L1 memory objects: one contiguous, page-aligned block of a shared-memory segment.

An :class:`L1Object` is what the transfer engine gathers engine KV into and
scatters it out of. It exposes the bytes three ways: a writable
``memoryview``, a ``torch`` uint8 tensor sharing the same memory (what the
node's own copies use), and a
``(path, offset, size)`` location so another process (an engine-driven
client) can map exactly the same bytes.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensor() imports it: a storage node starts without torch
    import torch

#: Alignment of every object inside a segment (and of segment sizes): one page.
ALIGNMENT = 4096


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment``."""
    return (nbytes + alignment - 1) // alignment * alignment


@dataclass(frozen=True, slots=True)
class ShmLocation:
    """Where an object's bytes live: a file under the shm directory, and a byte range of it."""

    path: str
    offset: int
    size: int


class Segment:
    """One shared-memory file of the pool, mapped read-write into this process."""

    __slots__ = ("_tensor", "index", "mapping", "path", "size", "view")

    def __init__(self, index: int, path: str, size: int, mapping: mmap.mmap) -> None:
        self.index = index
        self.path = path
        self.size = size
        self.mapping = mapping
        self.view = memoryview(mapping)
        self._tensor: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole segment, made once (the copies slice it).

        It holds a buffer export of the mapping (through NumPy), so the mapping
        outlives every tensor over it: :meth:`release` with a copy in flight
        leaves the unmapping to the last view's end, as for a memoryview.
        """
        tensor = self._tensor
        if tensor is None:
            import numpy as np
            import torch

            # Two copy threads may both get here: each makes an equal tensor, one is kept.
            tensor = self._tensor = torch.from_numpy(np.frombuffer(self.mapping, dtype=np.uint8))
        return tensor

    def release(self) -> None:
        """Unmap the segment; tolerated while views are still exported (freed when they die)."""
        self._tensor = None
        try:
            self.view.release()
            self.mapping.close()
        except BufferError:
            # A caller still holds a view or tensor of this segment. The file is
            # unlinked by the pool anyway; the kernel frees the pages when the
            # last mapping goes away, so dropping our reference is enough.
            pass


class L1Object:
    """A block of L1 memory holding (or about to hold) one chunk.

    ``size`` is the exact number of bytes requested; ``capacity`` is the
    aligned span reserved in the segment. Views never extend past ``size``.
    A freed object must not be written: its bytes may belong to another
    object already (``released`` tells whether the pool took it back).
    """

    __slots__ = ("_released", "capacity", "offset", "segment", "size")

    def __init__(self, segment: Segment, offset: int, size: int, capacity: int) -> None:
        self.segment = segment
        self.offset = offset
        self.size = size
        self.capacity = capacity
        self._released = False

    @property
    def released(self) -> bool:
        """True once the pool has taken the memory back."""
        return self._released

    def mark_released(self) -> None:
        """Called by the pool when it frees the block."""
        self._released = True

    def view(self) -> memoryview:
        """Writable view of exactly ``size`` bytes (zero-copy)."""
        return self.segment.view[self.offset : self.offset + self.size]

    def tensor(self) -> torch.Tensor:
        """uint8 tensor of exactly ``size`` elements sharing the object's memory: a slice
        of the segment's tensor, a few times cheaper than a tensor over :meth:`view`."""
        return self.segment.tensor()[self.offset : self.offset + self.size]

    def location(self) -> ShmLocation:
        """The file and byte range another process maps to reach the same bytes."""
        return ShmLocation(self.segment.path, self.offset, self.size)

    def __repr__(self) -> str:
        return (
            f"L1Object(segment={self.segment.index}, offset={self.offset}, "
            f"size={self.size}, capacity={self.capacity})"
        )
