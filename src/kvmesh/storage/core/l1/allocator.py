"""Two-ended extent allocator over the pool's segments, with coalescing free lists.

Pure bookkeeping (no memory is touched here) so it can be tested with
millions of operations cheaply.

The L1 workload mixes *full* chunks (tens of MiB, one size per model
layout) with *partial* ones (the last chunk of a prompt: any smaller size).
A plain best-fit or first-fit lets partial chunks land in the holes that
evicted full chunks leave, so after a while no hole takes a full chunk
although plenty of memory is free (a simulation of 30 % partial chunks
refused ~20 % of full-chunk allocations with best-fit). So the allocator
keeps the two apart: objects of the largest size class (``large_bytes``,
learned as the largest size seen unless configured) are placed at the
start of the lowest-address hole that fits; smaller ones at the end of the
highest-address hole that fits. Full chunks pack from the bottom of the
pool, partials from the top, and a hole left by an evicted full chunk is
refilled by a full chunk (~2 % refusals in the same simulation). Freed
extents merge with free neighbours at once.

An object never spans two segments, because each object must be one
``(path, offset, size)`` range of one file. Not thread-safe: the pool
serialises calls under its lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from kvmesh.storage.core.l1.objects import ALIGNMENT, align_up


class ExtentAllocator:
    """Allocates aligned extents ``(segment, offset, capacity)`` inside registered segments."""

    def __init__(self, alignment: int = ALIGNMENT, large_bytes: int | None = None) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        # Fixed size class boundary, or None to learn it (largest capacity seen).
        self._large_fixed = None if large_bytes is None else align_up(large_bytes, alignment)
        self._largest_seen = 0
        # Free extents per segment: offsets in address order, and sizes in size
        # order (its last element says at once whether the segment can fit a request).
        self._segments: list[int] = []
        self._starts: dict[int, list[int]] = {}
        self._hole_sizes: dict[int, list[int]] = {}
        self._free_size: dict[tuple[int, int], int] = {}
        self._allocated: dict[tuple[int, int], int] = {}
        self.total_bytes = 0
        self.used_bytes = 0

    # -- segments ---------------------------------------------------------

    def add_segment(self, segment: int, size: int) -> None:
        """Register a new segment whose ``size`` bytes are all free."""
        if segment in self._starts:
            raise ValueError(f"segment {segment} is already registered")
        if size <= 0 or size % self.alignment:
            raise ValueError(f"segment size {size} must be a positive multiple of the alignment")
        bisect.insort(self._segments, segment)
        self._starts[segment] = []
        self._hole_sizes[segment] = []
        self.total_bytes += size
        self._insert_free(segment, 0, size)

    @property
    def segment_count(self) -> int:
        """Number of registered segments."""
        return len(self._segments)

    # -- allocation -------------------------------------------------------

    def is_large(self, nbytes: int) -> bool:
        """Whether an object of ``nbytes`` belongs to the large (full-chunk) class."""
        capacity = align_up(nbytes, self.alignment)
        threshold = self._large_fixed if self._large_fixed is not None else self._largest_seen
        return capacity >= threshold

    def allocate(self, nbytes: int) -> tuple[int, int, int] | None:
        """Reserve ``nbytes`` rounded up to the alignment; None when no hole is large enough.

        Returns ``(segment, offset, capacity)``.
        """
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        capacity = align_up(nbytes, self.alignment)
        large = self.is_large(nbytes)
        self._largest_seen = max(self._largest_seen, capacity)
        hole = self._find(capacity, large)
        if hole is None:
            return None
        segment, start, size = hole
        self._remove_free(segment, start)
        if large:
            offset = start
            if size > capacity:
                self._insert_free(segment, start + capacity, size - capacity)
        else:
            offset = start + size - capacity
            if size > capacity:
                self._insert_free(segment, start, size - capacity)
        self._allocated[(segment, offset)] = capacity
        self.used_bytes += capacity
        return segment, offset, capacity

    def free(self, segment: int, offset: int) -> int:
        """Return an extent, merging it with free neighbours; returns its capacity."""
        capacity = self._allocated.pop((segment, offset), None)
        if capacity is None:
            raise ValueError(f"double free or foreign extent: segment {segment} offset {offset}")
        self.used_bytes -= capacity
        starts = self._starts[segment]
        start, end = offset, offset + capacity
        i = bisect.bisect_left(starts, offset)
        if i < len(starts) and starts[i] == end:
            following = end
            end += self._free_size[(segment, following)]
            self._remove_free(segment, following)
        if i > 0:
            prev = starts[i - 1]
            if prev + self._free_size[(segment, prev)] == start:
                start = prev
                self._remove_free(segment, prev)
        self._insert_free(segment, start, end - start)
        return capacity

    def would_fit(self, sizes: Sequence[int]) -> bool:
        """Whether every size could be allocated at once right now (same placement rules)."""
        holes = {
            seg: [(off, self._free_size[(seg, off)]) for off in self._starts[seg]]
            for seg in self._segments
        }
        for nbytes in sorted(sizes, reverse=True):
            capacity = align_up(nbytes, self.alignment)
            large = self.is_large(nbytes)
            order = self._segments if large else reversed(self._segments)
            placed = False
            for seg in order:
                spans = holes[seg]
                indices = range(len(spans)) if large else range(len(spans) - 1, -1, -1)
                for i in indices:
                    off, size = spans[i]
                    if size < capacity:
                        continue
                    rest = size - capacity
                    if rest == 0:
                        del spans[i]
                    else:
                        spans[i] = (off + capacity, rest) if large else (off, rest)
                    placed = True
                    break
                if placed:
                    break
            if not placed:
                return False
        return True

    # -- introspection ----------------------------------------------------

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated in registered segments."""
        return self.total_bytes - self.used_bytes

    @property
    def largest_free_extent(self) -> int:
        """Size of the largest hole (0 when the pool is full)."""
        return max((sizes[-1] for sizes in self._hole_sizes.values() if sizes), default=0)

    @property
    def free_extent_count(self) -> int:
        """Number of holes; with full coalescing an idle segment has exactly one."""
        return len(self._free_size)

    def allocated_extents(self) -> list[tuple[int, int, int]]:
        """``(segment, offset, capacity)`` of every live allocation, for checks in tests."""
        return sorted((seg, off, cap) for (seg, off), cap in self._allocated.items())

    # -- internals --------------------------------------------------------

    def _find(self, capacity: int, large: bool) -> tuple[int, int, int] | None:
        """Lowest-address fitting hole for a large object, highest-address one otherwise."""
        order = self._segments if large else reversed(self._segments)
        for segment in order:
            sizes = self._hole_sizes[segment]
            if not sizes or sizes[-1] < capacity:
                continue
            starts = self._starts[segment]
            for offset in starts if large else reversed(starts):
                size = self._free_size[(segment, offset)]
                if size >= capacity:
                    return segment, offset, size
        return None

    def _insert_free(self, segment: int, offset: int, size: int) -> None:
        bisect.insort(self._starts[segment], offset)
        bisect.insort(self._hole_sizes[segment], size)
        self._free_size[(segment, offset)] = size

    def _remove_free(self, segment: int, offset: int) -> None:
        size = self._free_size.pop((segment, offset))
        starts = self._starts[segment]
        del starts[bisect.bisect_left(starts, offset)]
        sizes = self._hole_sizes[segment]
        del sizes[bisect.bisect_left(sizes, size)]
