"""The directory's L1 reverse index: which keys each instance holds on L1.

Per instance, 256 small dicts ``ck → None`` (a key of directory shard
``si`` lives in index shard ``si >> INDEX_SHIFT``), so the clean-up after a
fence visits only that instance's keys and the dicts stay untracked by the
GC. A fence detaches the instance's index at once; the detached shards wait
in :attr:`L1Index.backlog` until the directory's sweep has rewritten their
records, a slice at a time.

Not thread-safe: the directory's lock guards it.
"""

from __future__ import annotations

import gc
import itertools
from collections import deque
from collections.abc import Callable, Iterable

INDEX_SHIFT = 4  # 4096 directory shards → 256 reverse-index shards per instance

IndexShards = dict[int, dict[bytes, None]]
"""One instance's index: index shard number → ``{ck: None}``."""

# Runs a map() of dict.__setitem__ to the end in C (a maxlen-0 deque keeps nothing).
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


class L1Index:
    """Per-instance L1 keys, and the detached indexes of fences still to sweep."""

    def __init__(self) -> None:
        self.by_instance: dict[str, IndexShards] = {}
        # Each item: the detached index shards of one fence, consumed with
        # popitem() so the keys' memory is freed slice by slice too.
        self.backlog: deque[list[dict[bytes, None]]] = deque()
        self.backlog_keys = 0

    def ensure(self, instance_id: str) -> IndexShards:
        """``instance_id``'s index, created empty on first use."""
        idx = self.by_instance.get(instance_id)
        if idx is None:
            idx = self.by_instance[instance_id] = {}
        return idx

    @staticmethod
    def add_bulk(idx: IndexShards, cks: list[bytes], sis: list[int]) -> None:
        """Index every key (``sis``: their directory shards) in C-level passes."""
        get = idx.get
        index_shards = []
        for si in sis:
            ish = get(si >> INDEX_SHIFT)
            if ish is None:
                ish = idx[si >> INDEX_SHIFT] = {}
            index_shards.append(ish)
        _consume(map(dict.__setitem__, index_shards, cks, itertools.repeat(None, len(cks))))

    def shard_holding(self, instance_id: str, ck: bytes, si: int) -> dict[bytes, None] | None:
        """The index shard of ``instance_id`` that holds ``ck``, or None."""
        idx = self.by_instance.get(instance_id)
        if idx is None:
            return None
        ish = idx.get(si >> INDEX_SHIFT)
        if ish is None or ck not in ish:
            return None
        return ish

    def detach(self, instance_id: str) -> tuple[bool, int]:
        """Move ``instance_id``'s index to the backlog: (it had one, keys now to sweep)."""
        idx = self.by_instance.pop(instance_id, None)
        n = sum(len(ish) for ish in idx.values()) if idx else 0
        if n:
            assert idx is not None
            self.backlog.append([ish for ish in idx.values() if ish])
            self.backlog_keys += n
        return bool(idx), n

    def counts(self) -> dict[str, int]:
        """L1 keys per instance (sums at most 256 dict sizes each)."""
        return {iid: sum(len(s) for s in idx.values()) for iid, idx in self.by_instance.items()}

    def is_empty(self) -> bool:
        """True when no instance has an L1 key indexed."""
        return not any(self.by_instance.values())

    def is_gc_untracked(self) -> bool:
        """True when no index dict is visible to the cyclic GC."""
        return not any(gc.is_tracked(s) for idx in self.by_instance.values() for s in idx.values())
