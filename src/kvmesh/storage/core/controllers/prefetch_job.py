"""One prefetch request at work: its state, and the load of its missing prefix from L2.

A :class:`PrefetchJob` is a grid of keys (rows are kv ranks / object groups,
columns are chunks) with the cells it holds read-locked in L1, staged for a
load, or pinned in an adapter. :class:`PrefetchLoader` runs steps 2 to 4 of
the :mod:`~kvmesh.storage.core.controllers.prefetch` docstring on a
prefetch worker: it asks each adapter which missing cells it holds, plans the
longest column prefix that L1 and L2 can serve, stages L1 objects for it,
loads them and publishes them read-locked. Whatever lies beyond the prefix
(staging, pins, read locks) is released as soon as the prefix is cut.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.controllers.l2tier import L2Tier
from kvmesh.storage.core.l1.manager import L1Manager
from kvmesh.storage.core.l1.objects import L1Object
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.l2.base import L2Unavailable
from kvmesh.storage.core.pins import PinTable

logger = logging.getLogger(__name__)

Cell = tuple[int, int]  # (row, column)


@dataclass(frozen=True, slots=True)
class PrefetchHandle:
    """Identifies one submitted prefetch."""

    id: int
    request_id: str


@dataclass(eq=False)
class PrefetchJob:
    """One submitted prefetch: its key grid, and the cells it holds, staged and pinned."""

    handle: PrefetchHandle
    rows: list[list[ObjectKey]]
    readers: int
    row_nbytes: list[int] | None
    held: list[list[bool]]
    loaded: set[Cell] = field(default_factory=set)
    staged: dict[Cell, tuple[L2Tier, L1Object]] = field(default_factory=dict)
    pins: dict[Cell, L2Tier] = field(default_factory=dict)
    #: May ask peers for the columns L1 and L2 miss (False for a peer's own request).
    allow_peers: bool = True
    #: When it was submitted, before it took any lock (its locks lapse a read TTL later).
    started: float = 0.0

    @property
    def num_chunks(self) -> int:
        return len(self.rows[0]) if self.rows else 0

    @property
    def tag(self) -> str:
        return f"prefetch:{self.handle.id}"

    def key(self, cell: Cell) -> ObjectKey:
        return self.rows[cell[0]][cell[1]]

    def held_prefix(self) -> int:
        """Columns held in every row, from the left (the first gap in any row ends it)."""
        prefix = self.num_chunks
        for row in self.held:
            if False in row:
                prefix = min(prefix, row.index(False))
        return prefix


class PrefetchLoader:
    """Loads jobs' missing prefixes from L2 into L1 (called on the prefetch workers).

    ``temporary``: objects loaded from L2 are freed when their last reader is
    done (the ``default`` prefetch policy). The counters are updated under
    ``lock``, the controller's, which reads them for its stats.
    """

    def __init__(
        self,
        l1: L1Manager,
        tiers: Sequence[L2Tier],
        pins: PinTable,
        *,
        temporary: bool,
        lock: threading.Condition,
    ) -> None:
        self.l1 = l1
        self.tiers = list(tiers)
        self.pins = pins
        self.temporary = temporary
        self._lock = lock
        self.l2_loaded_cells = 0
        self.l2_failed_cells = 0
        self.oom_cells = 0

    def load(self, job: PrefetchJob) -> int:
        """Load the missing prefix of ``job`` from L2; the column it ends at (held from 0)."""
        start = job.held_prefix()
        width, height = job.num_chunks, len(job.rows)
        missing = [(r, c) for c in range(start, width) for r in range(height) if not job.held[r][c]]
        sizes = self._cell_sizes(job, missing)
        for tier in self.tiers:
            ask = [cell for cell in missing if cell not in job.pins and sizes.get(cell)]
            if not ask or not tier.available():
                continue
            pinned = self.pins.pin(tier.name, [job.key(c) for c in ask])
            ask = [cell for cell, ok in zip(ask, pinned, strict=True) if ok]
            for cell in ask:
                job.pins[cell] = tier
            try:
                present = tier.contains([job.key(c) for c in ask])
            except L2Unavailable:
                present = [False] * len(ask)
            self._unpin(job, [c for c, ok in zip(ask, present, strict=True) if not ok])

        # Plan: the longest prefix every row can serve from L1 or some adapter.
        end = start
        for c in range(start, width):
            if not all(job.held[r][c] or (r, c) in job.pins for r in range(height)):
                break
            end = c + 1
        self._unpin(job, [cell for cell in list(job.pins) if cell[1] >= end])
        self.release(job, end)
        if end == start:
            return start

        end = self._stage(job, sizes, end)
        for tier in self.tiers:
            cells = sorted(
                (c for c, (t, _) in job.staged.items() if t is tier), key=lambda rc: rc[1]
            )
            if not cells:
                continue
            end = self._load_from(job, tier, cells, end)
        return min(end, job.held_prefix())

    def _cell_sizes(self, job: PrefetchJob, cells: list[Cell]) -> dict[Cell, int]:
        """Object size per cell: given per row, else an adapter index, else the row's L1 size."""
        sizes: dict[Cell, int] = {}
        row_guess: dict[int, int | None] = {}
        for r, c in cells:
            if job.row_nbytes is not None:
                sizes[(r, c)] = job.row_nbytes[r]
                continue
            key = job.rows[r][c]
            known = next((s for t in self.tiers if (s := t.index.size_of(key)) is not None), None)
            if known is None:
                if r not in row_guess:
                    row_guess[r] = next(
                        (
                            s
                            for cc, held in enumerate(job.held[r])
                            if held and (s := self.l1.size_of(job.rows[r][cc])) is not None
                        ),
                        None,
                    )
                known = row_guess[r]
            if known is None:
                logger.debug("prefetch %s: size of %s unknown", job.handle.request_id, key)
                continue
            sizes[(r, c)] = known
        return sizes

    def _stage(self, job: PrefetchJob, sizes: dict[Cell, int], end: int) -> int:
        """Reserve L1 staging for the planned cells before ``end``; returns the new end."""
        cells = sorted(job.pins, key=lambda rc: (rc[1], rc[0]))
        results, objects = self.l1.reserve_write(
            [job.key(c) for c in cells],
            [sizes[c] for c in cells],
            tag=job.tag,
            temporary=self.temporary,
            from_l2=True,
        )
        for cell, res in zip(cells, results, strict=True):
            if res is L1Result.SUCCESS:
                job.staged[cell] = (job.pins[cell], objects[job.key(cell)])
            elif (
                res is L1Result.KEY_NOT_WRITABLE
                and self.l1.reserve_read([job.key(cell)], job.readers)[0] is L1Result.SUCCESS
            ):
                # Someone stored the key meanwhile: serve it from L1.
                job.held[cell[0]][cell[1]] = True
                self._unpin(job, [cell])
            else:
                if res is L1Result.OUT_OF_MEMORY:
                    with self._lock:
                        self.oom_cells += 1
                end = min(end, cell[1])
        self.drop_after(job, end)
        return end

    def _load_from(self, job: PrefetchJob, tier: L2Tier, cells: list[Cell], end: int) -> int:
        """Load one adapter's staged cells before ``end``; returns the new end."""
        cells = [c for c in cells if c[1] < end]
        self.drop_after(job, end)
        if not cells:
            return end
        keys = [job.key(c) for c in cells]
        try:
            ok = tier.get_into(keys, [job.staged[c][1].view() for c in cells])
        except L2Unavailable:
            ok = [False] * len(cells)
        good = [c for c, g in zip(cells, ok, strict=True) if g]
        bad = [c for c, g in zip(cells, ok, strict=True) if not g]
        if good:
            published = self.l1.finish_write_and_reserve_read(
                [job.key(c) for c in good], job.readers, tag=job.tag
            )
            for cell, res in zip(good, published, strict=True):
                job.staged.pop(cell, None)
                if res is L1Result.SUCCESS:
                    job.held[cell[0]][cell[1]] = True
                    job.loaded.add(cell)
                else:
                    end = min(end, cell[1])
            with self._lock:
                self.l2_loaded_cells += len(good)
        if bad:
            with self._lock:
                self.l2_failed_cells += len(bad)
            self.l1.finish_write_and_delete([job.key(c) for c in bad], tag=job.tag)
            for cell in bad:
                job.staged.pop(cell, None)
            end = min(end, *(c[1] for c in bad))
            logger.info(
                "prefetch %s: %d loads from L2 %s failed; prefix cut to %d chunks",
                job.handle.request_id,
                len(bad),
                tier.name,
                end,
            )
        self._unpin(job, cells)
        return end

    def drop_after(self, job: PrefetchJob, end: int) -> None:
        """Discard staging and pins of cells at or after column ``end``."""
        late = [c for c in job.staged if c[1] >= end]
        if late:
            self.l1.finish_write_and_delete([job.key(c) for c in late], tag=job.tag)
            for cell in late:
                del job.staged[cell]
        self._unpin(job, [c for c in job.pins if c[1] >= end])

    def _unpin(self, job: PrefetchJob, cells: Sequence[Cell]) -> None:
        by_tier: dict[str, list[ObjectKey]] = {}
        for cell in cells:
            tier = job.pins.pop(cell, None)
            if tier is not None:
                by_tier.setdefault(tier.name, []).append(job.key(cell))
        for name, keys in by_tier.items():
            self.pins.unpin(name, keys)

    def release(self, job: PrefetchJob, end: int) -> None:
        """Release the read locks held on cells at or after column ``end``.

        A job that ran past the read TTL (a long queue of slow loads) does not
        release the locks it took at its start: they lapsed, and their counts
        may be newer readers' now. What it loaded was locked later, at the load.
        """
        cells = [(r, c) for r, row in enumerate(job.held) for c in range(end, len(row)) if row[c]]
        lapsed = self.l1.lapsed(job.started)
        kept = [c for c in cells if c in job.loaded] if lapsed else cells
        if kept:
            self.l1.finish_read([job.key(c) for c in kept], job.readers)
        if lapsed and len(kept) < len(cells):
            logger.warning(
                "prefetch %s ran %.0f s, past the read TTL: %d locks it took at its start "
                "lapsed and are dropped, not released",
                job.handle.request_id,
                self.l1.clock() - job.started,
                len(cells) - len(kept),
            )
        for r, c in cells:
            job.held[r][c] = False
            job.loaded.discard((r, c))
