"""A byte-weighted LRU index of object keys, globally and per cache_salt.

A leaf of the storage core: L1 eviction keeps its recency state in one and
every L2 tier its index, so it lives apart from both (neither imports the
other for it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from kvmesh.common.keys import ObjectKey

#: Keys handed out per eviction batch (``ByteLRU.oldest`` and the eviction controller).
DEFAULT_BATCH_KEYS = 64


class ByteLRU:
    """Keys with their sizes in recency order, globally and per cache_salt. Thread-safe.

    Used as the L1 eviction policy's state and as each L2 adapter's index.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: OrderedDict[ObjectKey, int] = OrderedDict()
        self._by_salt: dict[str, OrderedDict[ObjectKey, int]] = {}
        self._salt_bytes: dict[str, int] = {}
        self._total = 0

    def add(self, keys: Iterable[ObjectKey], sizes: Iterable[int]) -> None:
        """Insert keys (or refresh them) as most recently used."""
        with self._lock:
            for key, size in zip(keys, sizes, strict=True):
                self._discard_locked(key)
                self._all[key] = size
                self._by_salt.setdefault(key.cache_salt, OrderedDict())[key] = size
                self._salt_bytes[key.cache_salt] = self._salt_bytes.get(key.cache_salt, 0) + size
                self._total += size

    def remove(self, keys: Iterable[ObjectKey]) -> int:
        """Forget keys; returns the bytes they accounted for."""
        with self._lock:
            return sum(self._discard_locked(k) for k in keys)

    def items(self) -> list[tuple[ObjectKey, int]]:
        """Every key with its size, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._all.items())

    def touch(self, keys: Iterable[ObjectKey]) -> None:
        """Move known keys to the most recently used end."""
        with self._lock:
            for key in keys:
                if key in self._all:
                    self._all.move_to_end(key)
                    self._by_salt[key.cache_salt].move_to_end(key)

    def oldest(
        self,
        need_bytes: int,
        *,
        salt: str | None = None,
        skip: Iterable[ObjectKey] = (),
        max_keys: int = DEFAULT_BATCH_KEYS,
    ) -> list[tuple[ObjectKey, int]]:
        """Least recently used keys (of one salt, or all) adding up to ``need_bytes``.

        At least one key when any is left; never more than ``max_keys``.
        """
        skipped = set(skip)
        out: list[tuple[ObjectKey, int]] = []
        total = 0
        with self._lock:
            order = self._all if salt is None else self._by_salt.get(salt, OrderedDict())
            for key, size in order.items():
                if key in skipped:
                    continue
                out.append((key, size))
                total += size
                if total >= need_bytes or len(out) >= max_keys:
                    break
        return out

    def size_of(self, key: ObjectKey) -> int | None:
        """Recorded size of a key, or None."""
        with self._lock:
            return self._all.get(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._all

    def __len__(self) -> int:
        with self._lock:
            return len(self._all)

    @property
    def total_bytes(self) -> int:
        """Sum of all recorded sizes."""
        with self._lock:
            return self._total

    def salt_bytes(self, salt: str) -> int:
        """Sum of one salt's recorded sizes."""
        with self._lock:
            return self._salt_bytes.get(salt, 0)

    def bytes_by_salt(self) -> dict[str, int]:
        """Recorded bytes per salt."""
        with self._lock:
            return dict(self._salt_bytes)

    def keys(self) -> list[ObjectKey]:
        """Snapshot, least recently used first."""
        with self._lock:
            return list(self._all)

    def _discard_locked(self, key: ObjectKey) -> int:
        size = self._all.pop(key, None)
        if size is None:
            return 0
        salt = key.cache_salt
        per = self._by_salt[salt]
        del per[key]
        left = self._salt_bytes[salt] - size
        if per:
            self._salt_bytes[salt] = left
        else:
            del self._by_salt[salt]
            del self._salt_bytes[salt]
        self._total -= size
        return size
