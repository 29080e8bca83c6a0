"""The contract every L2 backend implements, and the errors it raises.

An adapter is a thin, blocking, thread-safe client of one backend (a
directory, a Redis server, an S3 bucket, a NIXL agent, or memory). It knows
nothing of L1, locks or eviction policy: the store and prefetch controllers
call it from their worker threads, so a slow backend never blocks an RPC
handler. Objects are opaque byte strings of exactly the size they were
written with; an adapter never serves a partial ("torn") object.

Failure model: a missing object is not an error (``get_into`` returns
False). A backend that cannot be reached or answers garbage raises
:class:`L2Unavailable` within the adapter's configured timeout — it never
hangs — and the storage node then degrades to L1-only for that adapter.

Rules every adapter follows (the conformance suite in tests/integration/storage/l2
checks them against the real backends):
- 0-byte objects are valid objects;
- on a miss or a size mismatch the output buffer is left untouched;
- an object that fails its integrity check is a miss and is removed (it is
  not an exception: one bad object must not fail the whole batch);
- after ``close()`` every call raises L2Unavailable;
- ``usage()`` and ``iter_entries()`` may scan the whole backend (Redis, S3):
  keep them off hot paths.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvmesh.common.errors import InvalidArgument, Unavailable
from kvmesh.common.keys import ObjectKey, validate_object_key


class L2Unavailable(Unavailable):
    """The backend is down, timed out, or returned something unusable."""

    default_reason = "L2_UNAVAILABLE"


class L2ObjectCorrupt(L2Unavailable):
    """A stored object is unusable. Adapters report corrupt objects as misses instead;
    this type is for callers that wrap an adapter and want to tell the cases apart."""

    default_reason = "L2_OBJECT_CORRUPT"


@dataclass(frozen=True, slots=True)
class L2Entry:
    """One stored object as listed by :meth:`L2Adapter.iter_entries`."""

    key: ObjectKey
    size_bytes: int


@dataclass(frozen=True, slots=True)
class L2Usage:
    """Bytes held by an adapter and its declared capacity (0 = undeclared)."""

    used_bytes: int
    capacity_bytes: int
    object_count: int


@runtime_checkable
class L2Adapter(Protocol):
    """A blocking, thread-safe client of one L2 backend."""

    #: Backend name reported in cache events and metrics ("disk", "redis", "s3", ...).
    backend: str
    #: True when several nodes mount the same pool (an S3 bucket, a shared Redis).
    shared: bool
    # An adapter may also set ``sole_writer = True``: nothing but this adapter
    # writes its backend, and ``iter_entries`` lists everything it holds (a
    # local directory it locks). The node's index of it is then complete, and
    # a lookup takes a key missing from the index as absent without asking the
    # adapter (see L2Tier.surely_absent). Optional: without it, the adapter is asked.

    def put_many(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> list[bool]:
        """Store each object atomically; returns per-item success.

        A key that already exists is overwritten (content for a key never
        changes, so this is idempotent). Raises L2Unavailable when the
        backend is down as a whole.
        """
        ...

    def get_into(self, keys: Sequence[ObjectKey], outs: Sequence[memoryview]) -> list[bool]:
        """Read each object into the matching buffer; per-key True when loaded.

        False means missing, or stored with a size different from the
        buffer's (never a partial copy that is reported as loaded).
        """
        ...

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Per-key presence."""
        ...

    def delete_many(self, keys: Sequence[ObjectKey]) -> int:
        """Delete the objects that exist; returns how many were removed. Idempotent."""
        ...

    def iter_entries(self) -> Iterator[L2Entry]:
        """Every stored object, for index rebuilds and reporting at start."""
        ...

    def usage(self) -> L2Usage:
        """Current byte usage and declared capacity."""
        ...

    def close(self) -> None:
        """Release connections and files. Stored objects persist."""
        ...


def usage_of(entries: Iterator[L2Entry], capacity_bytes: int) -> L2Usage:
    """Usage summed over a listing (for backends with no index of their own)."""
    used = count = 0
    for entry in entries:
        used += entry.size_bytes
        count += 1
    return L2Usage(used_bytes=used, capacity_bytes=capacity_bytes, object_count=count)


def byte_view(buf: memoryview, *, writable: bool = False, field: str = "buffer") -> memoryview:
    """Return ``buf`` as a flat unsigned-byte view (no copy).

    Callers hand in views of torch tensors or numpy arrays whose item size is
    not 1; every adapter works on bytes, so the view is cast once here.
    """
    if writable and buf.readonly:
        raise InvalidArgument(f"{field} must be writable", field=field)
    if buf.format == "B" and buf.ndim == 1:
        return buf
    if not buf.c_contiguous:
        raise InvalidArgument(f"{field} must be C-contiguous", field=field)
    return buf.cast("B")


def check_put_items(items: Sequence[tuple[ObjectKey, memoryview]]) -> list[memoryview]:
    """Validate the keys of a put batch and return flat byte views of the payloads.

    A key that breaks the key rules would be stored under a name that cannot
    be parsed back (so it could never be listed or deleted by key), hence the
    check before anything is written.
    """
    views: list[memoryview] = []
    for i, (key, data) in enumerate(items):
        validate_object_key(key, field=f"items[{i}].key")
        views.append(byte_view(data, field=f"items[{i}].data"))
    return views


def check_get_args(keys: Sequence[ObjectKey], outs: Sequence[memoryview]) -> list[memoryview]:
    """Check that there is one writable buffer per key; return flat byte views."""
    if len(keys) != len(outs):
        raise InvalidArgument(f"got {len(keys)} keys but {len(outs)} output buffers", field="outs")
    return [byte_view(out, writable=True, field=f"outs[{i}]") for i, out in enumerate(outs)]
