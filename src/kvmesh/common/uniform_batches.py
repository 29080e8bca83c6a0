"""The ingest fast path for batches whose entries differ only in their chunk hashes.

That is what a storage node sends: one model, rank, group and salt, one chunk
size, no token ids. Reading each field of a upb message from Python costs far
more than parsing it did, so such a batch is read from its own wire bytes:
the hashes are sliced out at a fixed stride and the batch is proven to be
exactly "entry 0 with each hash swapped in" by rebuilding its bytes
(:func:`uniform_hashes`). Its entries are then :class:`UniformEntries`,
columns that behave as the tuple of entries they stand for
(:mod:`kvmesh.common.convert` converts every other batch entry by entry).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator, Sequence
from typing import overload

from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.events import CacheEventEntry
from kvmesh.common.keys import CHUNK_HASH_BYTES, ObjectKey

__all__ = ["UNIFORM_MIN_ENTRIES", "UniformEntries", "uniform_hashes"]

# Wire bytes of the fields the uniform fast path locates (tag = field << 3 | 2).
_ENTRY_TAG = b"\x5a"  # CacheEventBatch.entries (field 11)
_KEY_TAG = b"\x0a"  # CacheEventEntry.key (field 1)
_HASH_HEAD = b"\x0a\x20"  # ObjectKey.chunk_hash (field 1), 32 bytes long
_TRACEPARENT_TAG = b"\x62"  # CacheEventBatch.traceparent (field 12)
#: Below this many entries the per-entry conversion is as cheap as the proof.
UNIFORM_MIN_ENTRIES = 6
#: Batches up to this many entries read their hashes with one cached Struct each.
_HASH_COLUMNS_MAX = 1024


class UniformEntries(Sequence[CacheEventEntry]):
    """Entries of one batch that differ only in their chunk hash, kept as columns.

    Entry ``i`` is ``template`` with ``chunk_hashes[i]`` as its key's chunk
    hash. Everywhere a batch's entries are read it behaves as the tuple of
    CacheEventEntry it stands for (built on first use: indexing, iteration,
    equality with a tuple, hashing); the coordinator core reads the columns
    instead (``kvmesh.coordinator.core.keyspace.ColumnarEntries``).
    """

    __slots__ = ("_tuple", "chunk_hashes", "template")

    def __init__(self, chunk_hashes: Sequence[bytes], template: CacheEventEntry) -> None:
        self.chunk_hashes = chunk_hashes
        self.template = template
        self._tuple: tuple[CacheEventEntry, ...] | None = None

    def as_tuple(self) -> tuple[CacheEventEntry, ...]:
        """The entries as a tuple (made once)."""
        entries = self._tuple
        if entries is None:
            new = tuple.__new__
            key = self.template.key
            _h, model, rank, group, salt = key
            _k, size, tokens, offset, segment = self.template
            entries = self._tuple = tuple(
                new(
                    CacheEventEntry,
                    (new(ObjectKey, (h, model, rank, group, salt)), size, tokens, offset, segment),
                )
                for h in self.chunk_hashes
            )
        return entries

    def __len__(self) -> int:
        return len(self.chunk_hashes)

    @overload
    def __getitem__(self, index: int) -> CacheEventEntry: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[CacheEventEntry, ...]: ...

    def __getitem__(self, index: int | slice) -> CacheEventEntry | tuple[CacheEventEntry, ...]:
        return self.as_tuple()[index]

    def __iter__(self) -> Iterator[CacheEventEntry]:
        return iter(self.as_tuple())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, UniformEntries):
            other = other.as_tuple()
        if isinstance(other, tuple):
            return self.as_tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        return repr(self.as_tuple())


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def uniform_hashes(
    msg: events_pb2.CacheEventBatch, header: bytes, traceparent: str
) -> Sequence[bytes] | None:
    """The chunk hashes of ``msg`` when its entries differ only in them, else None.

    ``header`` is the wire form of ``msg``'s fields 1-10 and ``traceparent`` its
    field 12, both from the values the caller has already read off ``msg``.
    """
    trailer = b""
    if traceparent:
        raw = traceparent.encode()
        trailer = _TRACEPARENT_TAG + _varint(len(raw)) + raw
    entries = msg.entries
    return _hashes_in(msg, entries[0], len(entries), header, trailer)


def _hashes_in(
    msg: events_pb2.CacheEventBatch,
    first: events_pb2.CacheEventEntry,
    n: int,
    fields: bytes,
    trailer: bytes,
) -> Sequence[bytes] | None:
    """The chunk hashes of ``msg`` when its ``n`` entries differ only in them, else None.

    ``fields`` is the wire form of ``msg``'s fields 1-10 and ``trailer``
    that of field 12 (``traceparent``). Every entry's record is then
    the first entry's record (``0x5a len body``, body = ``0x0a keylen 0x0a
    0x20 <hash> <rest of key> <rest of entry>``) with its own 32 hash bytes
    at one fixed offset, so the hashes are sliced out at a fixed stride and
    the message's own bytes are rebuilt from the pieces and compared: equal
    bytes parse to equal messages, so a match proves every entry equals the
    first with its hash swapped in. Any difference (a size, a token, another
    model, a hash of another length, an unknown field) is a mismatch and the
    caller converts entry by entry. The proof relies only on ``fields`` and
    the first entry being upb's own serializations (each field once, in
    field-number order; were they not, the bytes would just not match).
    """
    key_bytes = first.key.SerializeToString()
    body = first.SerializeToString()
    key_head = _KEY_TAG + _varint(len(key_bytes)) + _HASH_HEAD
    if not body.startswith(key_head):
        return None  # the first hash is not 32 bytes (or the key is empty)
    head = _ENTRY_TAG + _varint(len(body)) + key_head
    tail = body[len(key_head) + CHUNK_HASH_BYTES :]
    step = len(head) + CHUNK_HASH_BYTES + len(tail)
    whole = msg.SerializeToString()
    start = len(fields)
    stop = start + n * step
    if len(whole) != stop + len(trailer):
        return None
    first_at = start + len(head)
    hashes: Sequence[bytes]
    if n <= _HASH_COLUMNS_MAX:
        hashes = _hash_columns(step, n).unpack_from(whole, first_at)
    else:
        hashes = [whole[p : p + CHUNK_HASH_BYTES] for p in range(first_at, stop, step)]
    if whole != b"".join((fields, head, (tail + head).join(hashes), tail, trailer)):
        return None
    return hashes


@functools.lru_cache(maxsize=64)
def _hash_columns(step: int, n: int) -> struct.Struct:
    """Reads ``n`` chunk hashes ``step`` bytes apart in one C call (a slice per hash costs more)."""
    skip = step - CHUNK_HASH_BYTES
    return struct.Struct("<" + f"{CHUNK_HASH_BYTES}s{skip}x" * (n - 1) + f"{CHUNK_HASH_BYTES}s")
