"""Pins: reference counts on L2 chunk keys that fleet eviction must skip.

See docs/coordinator.md, "Pins".

A pin is counted on the chunk key with ``object_group_id`` forced to 0, so
one pin covers every object group of the chunk. Pins are operator intent,
saved as metadata (LMCache's EncodedObjectKey shape, see
:meth:`PinTable.capture`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey

from .persistence import PersistenceType
from .types import PinEntry, PinPage

_PinKey = tuple[bytes, str, int, str]
"""(chunk_hash, model_name, kv_rank, cache_salt): the key with object_group_id 0."""


def _pin_key(key: ObjectKey) -> _PinKey:
    return (key[0], key[1], key[2], key[4])


class PinTable:
    """Reference-counted L2 pins on chunk keys, in first-pinned order."""

    name = "pins"
    persistence_type = PersistenceType.METADATA

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[_PinKey, int] = {}

    def pin(self, keys: Iterable[ObjectKey]) -> int:
        """Add one pin to each key; returns how many keys were given."""
        n = 0
        with self._lock:
            for key in keys:
                pk = _pin_key(key)
                self._counts[pk] = self._counts.get(pk, 0) + 1
                n += 1
        return n

    def unpin(self, keys: Iterable[ObjectKey]) -> int:
        """Remove one pin from each key (never below zero); returns how many keys were given."""
        n = 0
        with self._lock:
            for key in keys:
                n += 1
                pk = _pin_key(key)
                c = self._counts.get(pk)
                if c is None:
                    continue
                if c <= 1:
                    del self._counts[pk]
                else:
                    self._counts[pk] = c - 1
        return n

    def drop_pins(self, keys: Iterable[ObjectKey]) -> int:
        """Remove every pin of each key whatever its count; returns how many were pinned."""
        with self._lock:
            return sum(self._counts.pop(_pin_key(k), None) is not None for k in keys)

    def is_pinned(self, key: ObjectKey) -> bool:
        """True when ``key`` (any object group) is pinned."""
        return _pin_key(key) in self._counts

    def is_pinned_parts(self, chunk_hash: bytes, model: str, kv_rank: int, salt: str) -> bool:
        """Same as :meth:`is_pinned` from the key's parts."""
        return (chunk_hash, model, kv_rank, salt) in self._counts

    def pin_count(self, key: ObjectKey) -> int:
        """Pins on ``key`` (0 when none)."""
        return self._counts.get(_pin_key(key), 0)

    def filter_unpinned(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """The unpinned keys, in order."""
        return [k for k in keys if _pin_key(k) not in self._counts]

    def __len__(self) -> int:
        return len(self._counts)

    def list_pins(
        self,
        cache_salt: str | None = None,
        model_name: str | None = None,
        limit: int = 1000,
        page_token: str = "",
    ) -> PinPage:
        """A page of pins in first-pinned order, optionally filtered by salt and model.

        The page token is the position in the filtered list (pins are operator
        intent and change rarely; concurrent pin changes may shift a page).
        """
        if not 1 <= limit <= 10_000:
            raise InvalidArgument("limit must be in [1, 10000]", field="page_size")
        try:
            offset = int(page_token) if page_token else 0
        except ValueError:
            offset = -1
        if offset < 0:
            raise InvalidArgument("malformed page token", field="page_token")
        with self._lock:
            rows = [
                (pk, c)
                for pk, c in self._counts.items()
                if (cache_salt is None or pk[3] == cache_salt)
                and (model_name is None or pk[1] == model_name)
            ]
        page = tuple(
            PinEntry(ObjectKey(pk[0], pk[1], pk[2], 0, pk[3]), c)
            for pk, c in rows[offset : offset + limit]
        )
        nxt = str(offset + limit) if offset + limit < len(rows) else ""
        return PinPage(total=len(rows), pins=page, next_page_token=nxt)

    def capture(self) -> dict[str, object]:
        """``{"entries": [{"key": {...}, "count": n}]}``.

        The key is LMCache's EncodedObjectKey shape: ``chunk_hash_hex``,
        ``model_name``, ``kv_rank``, ``object_group_id`` (0), ``cache_salt``.
        """
        with self._lock:
            return {
                "entries": [
                    {
                        "key": {
                            "chunk_hash_hex": pk[0].hex(),
                            "model_name": pk[1],
                            "kv_rank": pk[2],
                            "object_group_id": 0,
                            "cache_salt": pk[3],
                        },
                        "count": c,
                    }
                    for pk, c in self._counts.items()
                ]
            }

    def restore(self, state: object) -> None:
        """Replace the pins; counts ≤ 0 are dropped, rows of one chunk key are merged."""
        if not isinstance(state, Mapping):
            raise TypeError("pins state must be a mapping")
        counts: dict[_PinKey, int] = {}
        for row in state.get("entries", []):
            k = row["key"]
            count = int(row["count"])
            if count <= 0:
                continue
            pk = (
                bytes.fromhex(k["chunk_hash_hex"]),
                str(k["model_name"]),
                int(k["kv_rank"]),
                str(k.get("cache_salt", "")),
            )
            counts[pk] = counts.get(pk, 0) + count
        with self._lock:
            self._counts = counts
