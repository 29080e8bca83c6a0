"""IsolatedLRU: the per-salt LRU order of L2 keys that fleet eviction plans from.

Storage: per salt, up to 4096 small dicts ``ck → stamp`` (sharded like the
directory, untracked by the GC, copy-on-write for checkpoints and for the
planner's snapshot). A stamp is one shared int per batch, so the exact
global order is a k-way merge of the shards; keys of one batch tie.

The LRU changes only when batches come in (the eviction controller feeds it
L2 STORE, ACCESS and DELETE), never when a delete is merely sent.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import cast

from kvmesh.common.keys import ObjectKey

from .keyspace import SHARD_BITS, EncodedBatch, KeySpaces, space_id_of
from .persistence import PersistenceType

# The directory's sharding, so a batch's shard numbers are computed once for both.
_LRU_SHARD_BITS = SHARD_BITS
_LRU_MASK = (1 << _LRU_SHARD_BITS) - 1
# Runs a map() to the end in C (a maxlen-0 deque keeps nothing).
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


class _SaltBucket:
    __slots__ = ("count", "frozen", "shards")

    def __init__(self) -> None:
        self.shards: dict[int, dict[bytes, int]] = {}
        self.frozen: set[int] = set()
        self.count = 0

    def for_write(self, k: int) -> dict[bytes, int]:
        """Shard ``k`` to write to: created if missing, copied if a snapshot holds it."""
        sh = self.writable(k, True)
        assert sh is not None
        return sh

    def writable(self, k: int, create: bool) -> dict[bytes, int] | None:
        sh = self.shards.get(k)
        if sh is None:
            if not create:
                return None
            sh = self.shards[k] = {}
        elif k in self.frozen:
            sh = self.shards[k] = sh.copy()
            self.frozen.discard(k)
        return sh


class IsolatedLRU:
    """Per-salt LRU order of L2 keys (compact keys), oldest first."""

    name = "lru_order"
    persistence_type = PersistenceType.CHECKPOINT

    def __init__(self, spaces: KeySpaces) -> None:
        self._spaces = spaces
        self._lock = threading.Lock()
        self._salts: dict[str, _SaltBucket] = {}
        self._stamp = 0
        self._holds = 0

    def _bucket(self, sid: int, create: bool) -> tuple[str, _SaltBucket | None]:
        salt = self._spaces.salt(sid)
        bucket = self._salts.get(salt)
        if bucket is None and create:
            bucket = self._salts[salt] = _SaltBucket()
        return salt, bucket

    def on_keys_created(self, cks: Sequence[bytes], sids: Sequence[int]) -> None:
        """Insert keys, or move tracked ones, to the most-recent end (``sids``: their spaces)."""
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
            last_sid = -1
            bucket = _SaltBucket()
            shards = bucket.shards
            frozen = bucket.frozen
            grown = 0
            for ck, sid in zip(cks, sids, strict=True):
                if sid != last_sid:
                    bucket.count += grown
                    grown = 0
                    _salt, b = self._bucket(sid, True)
                    assert b is not None
                    bucket = b
                    shards = bucket.shards
                    frozen = bucket.frozen
                    last_sid = sid
                k = hash(ck) & _LRU_MASK
                sh = shards.get(k)
                if sh is None:
                    sh = shards[k] = {}
                elif frozen and k in frozen:
                    sh = bucket.writable(k, False)
                    assert sh is not None
                if sh.pop(ck, None) is None:
                    grown += 1
                sh[ck] = stamp
            bucket.count += grown

    def on_batch_created(self, encoded: EncodedBatch) -> None:
        """:meth:`on_keys_created` of one batch's keys, in bulk when they share one salt.

        Same effect, key by key: each key is removed if tracked and appended
        at the most-recent end, in entry order; only the per-key Python loop
        becomes C-level passes (which needs the keys to be distinct).
        """
        if encoded.sid < 0 or not encoded.unique:
            self.on_keys_created(encoded.cks, encoded.sids)
            return
        cks = encoded.cks
        sis = encoded.shards
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
            _salt, bucket = self._bucket(encoded.sid, True)
            assert bucket is not None
            found = list(map(bucket.shards.get, sis))
            if bucket.frozen or None in found:
                dicts = [bucket.for_write(k) for k in sis]
            else:
                dicts = cast(list[dict[bytes, int]], found)
            n = len(cks)
            # One probe per key appends the untracked ones: a store of fresh
            # keys (the common case) is done. Stamps only grow, so a key that
            # was tracked returns an older one; then every key of the batch
            # is moved to the end in entry order, the order the key-by-key
            # path leaves.
            stamps = list(map(dict.setdefault, dicts, cks, itertools.repeat(stamp, n)))
            tracked = n - stamps.count(stamp)
            if tracked:
                _consume(map(dict.pop, dicts, cks))
                _consume(map(dict.__setitem__, dicts, cks, itertools.repeat(stamp, n)))
            bucket.count += n - tracked

    def on_keys_touched(self, cks: Sequence[bytes], sids: Sequence[int]) -> None:
        """Move tracked keys to the most-recent end; unknown keys are ignored."""
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
            for ck, sid in zip(cks, sids, strict=True):
                _salt, bucket = self._bucket(sid, False)
                if bucket is None:
                    continue
                k = hash(ck) & _LRU_MASK
                sh = bucket.shards.get(k)
                if sh is None or ck not in sh:
                    continue
                sh = bucket.writable(k, False)
                assert sh is not None
                del sh[ck]
                sh[ck] = stamp

    def on_keys_removed(self, cks: Iterable[bytes], sids: Iterable[int]) -> None:
        """Forget keys; an emptied salt bucket is dropped."""
        with self._lock:
            for ck, sid in zip(cks, sids, strict=True):
                salt, bucket = self._bucket(sid, False)
                if bucket is None:
                    continue
                k = hash(ck) & _LRU_MASK
                sh = bucket.shards.get(k)
                if sh is None or ck not in sh:
                    continue
                sh = bucket.writable(k, False)
                assert sh is not None
                del sh[ck]
                bucket.count -= 1
                if not sh:
                    del bucket.shards[k]
                    bucket.frozen.discard(k)
                if bucket.count == 0:
                    del self._salts[salt]

    def contains(self, ck: bytes, salt: str) -> bool:
        """True when ``ck`` is tracked under ``salt``."""
        with self._lock:
            bucket = self._salts.get(salt)
            if bucket is None:
                return False
            sh = bucket.shards.get(hash(ck) & _LRU_MASK)
            return sh is not None and ck in sh

    def tracked_salts(self) -> list[str]:
        """Salts with at least one tracked key."""
        with self._lock:
            return list(self._salts)

    def count(self, salt: str) -> int:
        """Keys tracked under ``salt``."""
        with self._lock:
            b = self._salts.get(salt)
            return b.count if b is not None else 0

    def snapshot(
        self, salts: Iterable[str] | None = None
    ) -> dict[str, tuple[int, list[dict[bytes, int]]]]:
        """Per salt (all, or ``salts``): key count and shards, frozen copy-on-write (O(shards)).

        Pair every call with :meth:`release_snapshot` once the shards are no
        longer read.
        """
        with self._lock:
            out: dict[str, tuple[int, list[dict[bytes, int]]]] = {}
            chosen = self._salts if salts is None else dict.fromkeys(salts)
            for salt in chosen:
                bucket = self._salts.get(salt)
                if bucket is None:
                    continue
                bucket.frozen = set(bucket.shards)
                out[salt] = (bucket.count, list(bucket.shards.values()))
            self._holds += 1
            return out

    def release_snapshot(self) -> None:
        """A snapshot is no longer read; once none is, shards stop being copy-on-write."""
        with self._lock:
            self._holds = max(0, self._holds - 1)
            if self._holds == 0:
                for bucket in self._salts.values():
                    bucket.frozen.clear()

    release_capture = release_snapshot

    @staticmethod
    def oldest_first(shards: Sequence[Mapping[bytes, int]]) -> Iterator[bytes]:
        """Keys of a snapshot's shards in global LRU order (oldest first)."""
        for ck, _stamp in heapq.merge(*(iter(s.items()) for s in shards), key=itemgetter(1)):
            yield ck

    def order(self, salt: str) -> list[ObjectKey]:
        """Every key of ``salt``, oldest first (for tests and diagnostics)."""
        snap = self.snapshot([salt]).get(salt)
        try:
            if snap is None:
                return []
            return [self._spaces.decode(ck) for ck in self.oldest_first(snap[1])]
        finally:
            self.release_snapshot()

    def capture(self) -> dict[str, object]:
        """``{"spaces": table, "stamp": n, "shards": [[salt, {ck: stamp}]…]}`` (copy-on-write)."""
        snap = self.snapshot()
        with self._lock:
            stamp = self._stamp
        return {
            "spaces": self._spaces.table(),
            "stamp": stamp,
            "shards": [[salt, shard] for salt, (_n, shards) in snap.items() for shard in shards],
        }

    def restore(self, state: object) -> None:
        """Replace the LRU with a capture."""
        if not isinstance(state, Mapping):
            raise TypeError("lru_order state must be a mapping")
        table = state["spaces"]
        mapping = self._spaces.translation(table)
        n_spaces = len(table)
        salts: dict[str, _SaltBucket] = {}
        stamps: dict[int, int] = {}  # share one int object per stamp value
        max_stamp = int(state.get("stamp", 0))
        for salt, shard in state["shards"]:
            if not isinstance(salt, str) or not isinstance(shard, Mapping):
                raise TypeError("lru_order shard row is malformed")
            bucket = salts.get(salt)
            if bucket is None:
                bucket = salts[salt] = _SaltBucket()
            for raw_ck, raw_stamp in shard.items():
                if not isinstance(raw_ck, bytes) or not isinstance(raw_stamp, int):
                    raise TypeError("lru_order entry is malformed")
                ck = self._spaces.retranslate(raw_ck, mapping, n_spaces)
                if self._spaces.salt(space_id_of(ck)) != salt:
                    raise ValueError("lru_order key filed under the wrong salt")
                stamp = stamps.setdefault(raw_stamp, raw_stamp)
                max_stamp = max(max_stamp, stamp)
                sh = bucket.writable(hash(ck) & _LRU_MASK, True)
                assert sh is not None
                if ck not in sh:
                    bucket.count += 1
                sh[ck] = stamp
        # Keys from different captured shards may land in one shard here;
        # keep each shard in stamp order so merges stay exact.
        for bucket in salts.values():
            for k, sh in list(bucket.shards.items()):
                bucket.shards[k] = dict(sorted(sh.items(), key=itemgetter(1)))
        with self._lock:
            self._salts = salts
            self._stamp = max_stamp
