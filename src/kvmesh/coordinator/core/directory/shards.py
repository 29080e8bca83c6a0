"""The directory's key space: 4096 dicts ``ck → record``, copy-on-write for checkpoints.

One huge dict stalls for seconds when it resizes (measured: 1.5 s at 5.6 M
keys, mostly first-touch page faults); a shard of ~2.5 k keys resizes in
microseconds. A key lives in shard ``hash(ck) & MASK`` (the LRU shards the
same way, so a batch's shard numbers are computed once for both).

Shards are copy-on-write for checkpoints: :meth:`ShardStore.freeze` hands
out the live shard dicts and marks them frozen; the first later write to a
frozen shard replaces it with a copy (:meth:`ShardStore.thaw`). A capture
is O(shards), not O(keys), so the quiesce stays short, and the copying cost
is spread over later batches.

Hot loops read :attr:`ShardStore.shards` and :attr:`ShardStore.frozen`
directly (bound to locals once per batch) rather than calling a method per
key. Not thread-safe: the directory's lock guards it.
"""

from __future__ import annotations

import gc
import itertools
import operator

from kvmesh.coordinator.core.keyspace import SHARD_BITS, SHARD_MASK

NUM_SHARDS = 1 << SHARD_BITS
MASK = SHARD_MASK


class ShardStore:
    """The shard dicts, which of them a capture holds, and how many captures are held."""

    def __init__(self) -> None:
        self.shards: list[dict[bytes, bytes]] = [{} for _ in range(NUM_SHARDS)]
        self.frozen = bytearray(NUM_SHARDS)
        self._holds = 0

    def thaw(self, si: int) -> dict[bytes, bytes]:
        """Replace frozen shard ``si`` (shared with a capture) by a private copy."""
        shard = self.shards[si].copy()
        self.shards[si] = shard
        self.frozen[si] = 0
        return shard

    def insert_new(self, cks: list[bytes], sis: list[int], record: bytes) -> bool:
        """Insert every key with ``record`` if none exists yet; False (nothing changed) if one does.

        Each step is a C-level pass over the batch instead of a Python loop
        per key. ``sis`` are the keys' shard numbers. Frozen shards may have
        been copied when it returns False, which only anticipates the
        copy-on-write of the per-key path.
        """
        shards = self.shards
        if 1 in self.frozen:  # a capture holds some shards: copy the ones written
            frozen = self.frozen
            for si in set(sis):
                if frozen[si]:
                    self.thaw(si)
        dicts = list(map(shards.__getitem__, sis))
        n = len(cks)
        # One probe per key inserts the fresh ones; ``record`` is new, so a key
        # that existed is one whose value is not that very object.
        found = list(map(dict.setdefault, dicts, cks, itertools.repeat(record, n)))
        inserted = list(map(operator.is_, found, itertools.repeat(record, n))).count(True)
        if inserted != n:
            if inserted:  # some existed: undo, so the per-key path starts from the same state
                for d, ck, v in zip(dicts, cks, found, strict=True):
                    if v is record:
                        del d[ck]
            return False
        return True

    def sorted_keys(self, si: int) -> list[bytes]:
        """The keys of shard ``si`` in order (a listing walks shards this way)."""
        return sorted(self.shards[si])

    # -- captures ----------------------------------------------------------

    def freeze(self) -> list[dict[bytes, bytes]]:
        """Every shard, shared with the caller until :meth:`release` (O(shards))."""
        self.frozen[:] = b"\x01" * NUM_SHARDS
        self._holds += 1
        return list(self.shards)

    def release(self) -> None:
        """One capture was dropped; once none is held, shards stop being copy-on-write."""
        self._holds = max(0, self._holds - 1)
        if self._holds == 0:
            self.frozen = bytearray(NUM_SHARDS)

    def replace(self, shards: list[dict[bytes, bytes]]) -> None:
        """Swap in restored shards (nothing frozen)."""
        self.shards = shards
        self.frozen = bytearray(NUM_SHARDS)

    def is_gc_untracked(self) -> bool:
        """True when no shard dict is visible to the cyclic GC."""
        return not any(gc.is_tracked(s) for s in self.shards)
