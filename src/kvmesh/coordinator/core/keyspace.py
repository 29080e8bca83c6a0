"""Compact, interned encoding of ObjectKeys for the coordinator's big tables.

An ``ObjectKey`` namedtuple costs ~200 bytes with its hash object and is a
GC-tracked container (namedtuples are never untracked by the collector), so
ten million of them would both bloat memory and make every full collection
walk them. The core therefore stores a *compact key* instead::

    ck = chunk_hash || u32_le(space_id)

where ``space_id`` interns ``(model_name, kv_rank, object_group_id,
cache_salt)``. The space id sits at the end so a key decodes from the right
whatever its hash length. A dict of such ``bytes`` keys to ``bytes``/``int``
values holds no tracked object, so CPython leaves the dict itself untracked
and the collector never walks it (see ``gc.is_tracked``).

Batches whose entries differ only in their chunk hashes (what storage nodes
send; the servicer's conversion hands them over as columns, see
:class:`ColumnarEntries`) are encoded without touching a per-entry object,
and the encoding of the batch being broadcast is memoised with what the
consumers' bulk paths need (:class:`EncodedBatch`).

Spaces are few (models × ranks × groups × tenants) and are never forgotten;
ids are therefore stable for the process lifetime. A checkpoint section that
stores compact keys also stores the space table it used, and restoring it
translates ids through :meth:`KeySpaces.translation`, so sections restore in
any order into a codec that may already hold other spaces.
"""

from __future__ import annotations

import logging
import operator
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from kvmesh.common.events import CacheEventBatch, CacheEventEntry
from kvmesh.common.keys import ObjectKey

logger = logging.getLogger(__name__)

SPACE_BYTES = 4
_SUFFIX = struct.Struct("<I")
_MAX_SPACES = 1 << 32
#: The directory and the LRU both shard by ``hash(ck) & SHARD_MASK``.
SHARD_BITS = 12
SHARD_MASK = (1 << SHARD_BITS) - 1

SpaceTuple = tuple[str, int, int, str]
"""``(model_name, kv_rank, object_group_id, cache_salt)``."""

_TAIL: Callable[[ObjectKey], SpaceTuple] = operator.itemgetter(1, 2, 3, 4)


class ColumnarEntries(Protocol):
    """A batch's entries that differ only in their chunk hash, as columns.

    Entry ``i`` is ``template`` with ``chunk_hashes[i]`` as its key's chunk
    hash. ``kvmesh.common.uniform_batches.UniformEntries`` (the servicer's fast
    conversion) has this shape and is also a ``Sequence[CacheEventEntry]``,
    so a batch carrying it reads the same to every other caller.
    """

    @property
    def chunk_hashes(self) -> Sequence[bytes]:
        """One chunk hash per entry, in entry order."""
        ...

    @property
    def template(self) -> CacheEventEntry:
        """What every entry is, but for its chunk hash."""
        ...


def columnar(entries: Sequence[CacheEventEntry]) -> ColumnarEntries | None:
    """``entries`` as columns when they come as :class:`ColumnarEntries`, else None."""
    if getattr(entries, "chunk_hashes", None) is None:
        return None
    return cast(ColumnarEntries, entries)


class EncodedBatch:
    """The compact form of one batch's keys, shared by every consumer of that batch.

    ``cks`` and ``sids`` are per entry; ``sid`` is the one space of every
    entry (-1 when they differ); ``shards`` is ``hash(ck) & SHARD_MASK`` per
    entry and ``unique`` tells that no compact key repeats — together what
    the consumers' bulk (C-level) paths need. Treat every list as read-only.
    """

    __slots__ = ("_shards", "_unique", "cks", "sid", "sids")

    def __init__(self, cks: list[bytes], sids: list[int], sid: int) -> None:
        self.cks = cks
        self.sids = sids
        self.sid = sid
        self._shards: list[int] | None = None
        self._unique: bool | None = None

    @property
    def shards(self) -> list[int]:
        """``hash(ck) & SHARD_MASK`` of every compact key (computed once)."""
        shards = self._shards
        if shards is None:
            mask = SHARD_MASK
            shards = self._shards = [hash(ck) & mask for ck in self.cks]
        return shards

    @property
    def unique(self) -> bool:
        """True when no compact key appears twice (computed once)."""
        unique = self._unique
        if unique is None:
            unique = self._unique = len(set(self.cks)) == len(self.cks)
        return unique


_EMPTY = EncodedBatch([], [], -1)


def space_id_of(ck: bytes) -> int:
    """Space id of a compact key."""
    sid: int = _SUFFIX.unpack_from(ck, len(ck) - SPACE_BYTES)[0]
    return sid


def chunk_hash_of(ck: bytes) -> bytes:
    """Chunk hash of a compact key."""
    return ck[:-SPACE_BYTES]


class KeySpaces:
    """Interning table of key spaces, shared by every consumer of one coordinator.

    Also memoises the encoding of the batch being broadcast, so the
    directory and the eviction controller encode each entry once between
    them (consumers run one after the other under the gate lock, so the
    memo never sees two batches interleaved).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[SpaceTuple, int] = {}
        self._spaces: list[SpaceTuple] = []
        self._suffixes: list[bytes] = []
        # (model, kv_rank, salt) -> space ids of every object group seen.
        self._groups: dict[tuple[str, int, str], tuple[int, ...]] = {}
        self._memo_batch: CacheEventBatch | None = None
        self._memo = _EMPTY

    def __len__(self) -> int:
        return len(self._spaces)

    def intern(self, space: SpaceTuple) -> int:
        """Id of ``space``, allocating one on first sight."""
        sid = self._ids.get(space)
        if sid is not None:
            return sid
        with self._lock:
            sid = self._ids.get(space)
            if sid is not None:
                return sid
            sid = len(self._spaces)
            if sid >= _MAX_SPACES:
                raise OverflowError("more than 2**32 key spaces")
            model, rank, _group, salt = space
            # Append the lookup tables before publishing the id, so a reader
            # that finds the id can always resolve it.
            self._spaces.append(space)
            self._suffixes.append(_SUFFIX.pack(sid))
            gkey = (model, rank, salt)
            self._groups[gkey] = (*self._groups.get(gkey, ()), sid)
            self._ids[space] = sid
            return sid

    def find(self, space: SpaceTuple) -> int | None:
        """Id of ``space`` if it was ever interned (never allocates)."""
        return self._ids.get(space)

    def encode(self, key: ObjectKey) -> bytes:
        """Compact key of ``key``, interning its space."""
        sid = self.intern((key[1], key[2], key[3], key[4]))
        return key[0] + self._suffixes[sid]

    def find_key(self, key: ObjectKey) -> bytes | None:
        """Compact key of ``key``; None if its space is unknown (then it is stored nowhere)."""
        sid = self._ids.get((key[1], key[2], key[3], key[4]))
        if sid is None:
            return None
        return key[0] + self._suffixes[sid]

    def encode_with_space(self, chunk_hash: bytes, sid: int) -> bytes:
        """Compact key of ``chunk_hash`` in space ``sid``."""
        return chunk_hash + self._suffixes[sid]

    def encode_batch(self, batch: CacheEventBatch) -> EncodedBatch:
        """Compact keys and space ids of every entry of ``batch``, in entry order.

        The result is shared with every caller for the same batch object:
        treat it as read-only.
        """
        if batch is self._memo_batch:
            return self._memo
        entries = batch.entries
        if not entries:
            return _EMPTY
        cols = columnar(entries)
        if cols is not None:
            # One space for the whole batch, known without looking at an entry.
            key = cols.template.key
            tail = (key[1], key[2], key[3], key[4])
            sid = self._ids.get(tail)
            if sid is None:
                sid = self.intern(tail)
            suffix = self._suffixes[sid]
            hashes = cols.chunk_hashes
            encoded = EncodedBatch([h + suffix for h in hashes], [sid] * len(hashes), sid)
        else:
            encoded = self._encode_entries(entries)
        self._memo_batch = batch
        self._memo = encoded
        return encoded

    def _encode_entries(self, entries: Sequence[CacheEventEntry]) -> EncodedBatch:
        keys = [entry[0] for entry in entries]
        tails = set(map(_TAIL, keys))
        if len(tails) == 1:
            # The common case: one model, rank, group and salt per batch.
            (tail,) = tails
            sid = self._ids.get(tail)
            if sid is None:
                sid = self.intern(tail)
            suffix = self._suffixes[sid]
            return EncodedBatch([k[0] + suffix for k in keys], [sid] * len(keys), sid)
        ids = self._ids
        suffixes = self._suffixes
        cks: list[bytes] = []
        sids: list[int] = []
        last_tail: tuple[object, ...] = ()
        sid = -1
        suffix = b""
        for key in keys:
            # Entries of one batch almost always share a space; compare the
            # tail tuple instead of hashing it again.
            tail = key[1:]
            if tail != last_tail:
                found = ids.get(tail)
                if found is None:
                    found = self.intern((key[1], key[2], key[3], key[4]))
                sid = found
                suffix = suffixes[sid]
                last_tail = tail
            cks.append(key[0] + suffix)
            sids.append(sid)
        return EncodedBatch(cks, sids, -1)

    def decode(self, ck: bytes) -> ObjectKey:
        """ObjectKey of a compact key."""
        model, rank, group, salt = self._spaces[space_id_of(ck)]
        return ObjectKey(ck[:-SPACE_BYTES], model, rank, group, salt)

    def space(self, sid: int) -> SpaceTuple:
        """The ``(model, kv_rank, group, salt)`` tuple of ``sid``."""
        return self._spaces[sid]

    def salt(self, sid: int) -> str:
        """The cache salt of ``sid``."""
        return self._spaces[sid][3]

    def group_variants(self, model: str, kv_rank: int, salt: str) -> tuple[int, ...]:
        """Ids of every space ``(model, kv_rank, *, salt)`` seen, whatever its object group."""
        return self._groups.get((model, kv_rank, salt), ())

    def table(self) -> list[list[object]]:
        """Plain-data copy of the table, index = space id."""
        return [list(space) for space in self._spaces]

    def translation(self, table: Sequence[Sequence[object]]) -> list[int] | None:
        """Map a captured table's ids onto ours, interning as needed.

        Returns None when every id maps to itself (the common case of a
        restore into a fresh coordinator), so callers can skip rewriting.
        Raises ValueError on a malformed row.
        """
        mapping: list[int] = []
        identity = True
        for i, row in enumerate(table):
            if len(row) != 4:
                raise ValueError(f"key space row {i} has {len(row)} fields, expected 4")
            model, rank, group, salt = row
            if not (
                isinstance(model, str)
                and isinstance(rank, int)
                and isinstance(group, int)
                and isinstance(salt, str)
            ):
                raise ValueError(f"key space row {i} has wrong field types")
            sid = self.intern((model, rank, group, salt))
            identity = identity and sid == i
            mapping.append(sid)
        return None if identity else mapping

    def retranslate(self, ck: bytes, mapping: list[int] | None, table_len: int) -> bytes:
        """Rewrite a captured compact key through ``mapping`` (see :meth:`translation`).

        ``table_len`` is the length of the captured table; a key whose space
        id is outside it raises ValueError.
        """
        old = space_id_of(ck)
        if old >= table_len:
            raise ValueError(f"compact key refers to unknown key space {old}")
        if mapping is None:
            return ck
        return ck[:-SPACE_BYTES] + self._suffixes[mapping[old]]
