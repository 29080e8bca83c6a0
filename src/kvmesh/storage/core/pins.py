"""Pins of L2 keys that a prefetch is loading, against concurrent deletes.

A leaf of the storage core, shared by the prefetch controller (pins),
eviction and the manager's deletes (claims).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvmesh.common.keys import ObjectKey


class PinTable:
    """Keys of L2 adapters that must not be deleted now (a prefetch is loading them).

    Deleters claim keys first: a claimed key cannot be pinned, a pinned key
    cannot be claimed, so a key that a prefetch saw present is still there
    when it loads it. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pins: dict[tuple[str, ObjectKey], int] = {}
        self._deleting: set[tuple[str, ObjectKey]] = set()

    def pin(self, tier: str, keys: Sequence[ObjectKey]) -> list[bool]:
        """Pin each key; False for a key being deleted right now (treat it as missing)."""
        out: list[bool] = []
        with self._lock:
            for key in keys:
                slot = (tier, key)
                if slot in self._deleting:
                    out.append(False)
                    continue
                self._pins[slot] = self._pins.get(slot, 0) + 1
                out.append(True)
        return out

    def unpin(self, tier: str, keys: Iterable[ObjectKey]) -> None:
        """Release one pin per key."""
        with self._lock:
            for key in keys:
                slot = (tier, key)
                count = self._pins.get(slot, 0) - 1
                if count > 0:
                    self._pins[slot] = count
                else:
                    self._pins.pop(slot, None)

    def claim_for_delete(self, tier: str, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Mark the unpinned keys as being deleted and return them."""
        claimed: list[ObjectKey] = []
        with self._lock:
            for key in keys:
                slot = (tier, key)
                if slot in self._pins or slot in self._deleting:
                    continue
                self._deleting.add(slot)
                claimed.append(key)
        return claimed

    def release_delete(self, tier: str, keys: Iterable[ObjectKey]) -> None:
        """End a deletion claimed with :meth:`claim_for_delete`."""
        with self._lock:
            for key in keys:
                self._deleting.discard((tier, key))

    def is_pinned(self, tier: str, key: ObjectKey) -> bool:
        """Whether a prefetch holds the key."""
        with self._lock:
            return (tier, key) in self._pins

    @property
    def pinned_count(self) -> int:
        """Distinct pinned (adapter, key) pairs."""
        with self._lock:
            return len(self._pins)
