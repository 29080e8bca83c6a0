"""Conversions between the core's cache-event types and ``kvmesh.events.v1`` / ``common.v1``.

Shared by the storage node's event link (core → proto) and the coordinator's
ingest servicer (proto → core), so both ends agree on every field:

* enum values are the proto numbers (:mod:`kvmesh.common.events`), so an
  enum converts with ``int()``; a proto value the core has no member for
  (``UNSPECIFIED``, ``TIER_ALL``, a number from a newer contract) is
  :class:`~kvmesh.common.errors.InvalidArgument` naming the field;
* ``token_offset`` is ``optional`` on the wire: absent means unknown, which
  the core spells ``-1`` (:data:`~kvmesh.common.events.UNKNOWN_TOKEN_OFFSET`);
  ``0`` is a real position. Unknown is written as absent (the canonical form,
  and 11 bytes shorter than a varint ``-1``);
* ``token_ids`` come back as tuples, keys as :class:`ObjectKey`.

These functions convert; they do not validate, except
:func:`validated_batch_from_proto`, which is :func:`batch_from_proto` followed
by :func:`kvmesh.common.events.validate_batch` in one pass (the
coordinator's ingest). A batch converted otherwise still goes through
``validate_batch`` or was checked when it was recorded (the emitter).

The proto → core direction is on the coordinator's ingest hot path (the
target is well over 200k entries/s). Reading a field of a upb message from
Python costs far more than parsing it did, so a batch whose entries differ
only in their chunk hashes — what a storage node sends: one model, rank,
group and salt, one chunk size, no token ids — is read from its own wire
bytes: the hashes are sliced out at a fixed stride and the batch is proven
to be exactly "entry 0 with each hash swapped in" by rebuilding its bytes
(:mod:`kvmesh.common.uniform_batches`). Its entries come back as
:class:`~kvmesh.common.uniform_batches.UniformEntries`,
columns that behave as the tuple of entries they stand for, so the
coordinator core (which re-encodes keys to its compact form anyway) needs
no ObjectKey or CacheEventEntry per entry. Any other batch is converted
entry by entry, building the NamedTuples with ``tuple.__new__``, reading
each proto field exactly once, and validating each distinct model name and
salt of a batch once rather than per entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import (
    MAX_EVENT_TS,
    UNKNOWN_TOKEN_OFFSET,
    CacheEventBatch,
    CacheEventEntry,
    EventType,
    SegmentHead,
    Tier,
    segment_head_ok,
    validate_batch,
)
from kvmesh.common.keys import (
    CHUNK_HASH_BYTES,
    ObjectKey,
    validate_cache_salt,
    validate_model_name,
)
from kvmesh.common.uniform_batches import UNIFORM_MIN_ENTRIES, UniformEntries, uniform_hashes

__all__ = [
    "batch_from_proto",
    "batch_to_proto",
    "event_type_from_proto",
    "key_from_proto",
    "key_to_proto",
    "tier_from_proto",
    "validated_batch_from_proto",
]

# Lookup tables instead of ``EventType(value)``: a dict hit is cheaper than the
# enum constructor and an unknown value is a plain miss, not an exception.
_EVENT_TYPES: dict[int, EventType] = {int(t): t for t in EventType}
_TIERS: dict[int, Tier] = {int(t): t for t in Tier}


def key_to_proto(key: ObjectKey) -> common_pb2.ObjectKey:
    """The wire form of ``key``."""
    return common_pb2.ObjectKey(
        chunk_hash=key.chunk_hash,
        model_name=key.model_name,
        kv_rank=key.kv_rank,
        object_group_id=key.object_group_id,
        cache_salt=key.cache_salt,
    )


def key_from_proto(msg: common_pb2.ObjectKey) -> ObjectKey:
    """The core form of a wire key (not validated: see ``validate_object_key``)."""
    return ObjectKey(
        msg.chunk_hash, msg.model_name, msg.kv_rank, msg.object_group_id, msg.cache_salt
    )


def event_type_from_proto(value: int, field: str = "event_type") -> EventType:
    """The core event type of a proto ``CacheEventType``; InvalidArgument naming ``field``."""
    event_type = _EVENT_TYPES.get(value)
    if event_type is None:
        raise InvalidArgument(f"{field} {value} is not a known event type", field=field)
    return event_type


def tier_from_proto(value: int, field: str = "tier") -> Tier:
    """The core tier of a proto ``Tier`` (L1 or L2 only); InvalidArgument naming ``field``."""
    tier = _TIERS.get(value)
    if tier is None:
        raise InvalidArgument(
            f"{field} must be a concrete tier (TIER_L1 or TIER_L2), got {value}", field=field
        )
    return tier


def _segment_from_proto(wire: events_pb2.CacheEventEntry) -> SegmentHead | None:
    """A wire entry's segment head (None when unset)."""
    if not wire.HasField("segment"):
        return None
    return SegmentHead(tuple(wire.segment.head_tokens[:]), wire.segment.num_tokens)


def _fill_entry(entry: CacheEventEntry, out: events_pb2.CacheEventEntry) -> None:
    """Fill ``out`` (a fresh ``entries.add()``) from ``entry``."""
    key = entry.key
    wire_key = out.key
    wire_key.chunk_hash = key.chunk_hash
    wire_key.model_name = key.model_name
    wire_key.kv_rank = key.kv_rank
    wire_key.object_group_id = key.object_group_id
    wire_key.cache_salt = key.cache_salt
    out.size_bytes = entry.size_bytes
    if entry.token_ids:
        out.token_ids.extend(entry.token_ids)
    # Unknown travels as absent; anything else (even an invalid < -1) is sent
    # as is so the coordinator's validation names it instead of us hiding it.
    if entry.token_offset != UNKNOWN_TOKEN_OFFSET:
        out.token_offset = entry.token_offset
    if entry.segment is not None:
        out.segment.SetInParent()  # present even when empty (validation then names it)
        out.segment.head_tokens.extend(entry.segment.head_tokens)
        out.segment.num_tokens = entry.segment.num_tokens


def batch_to_proto(batch: CacheEventBatch) -> events_pb2.CacheEventBatch:
    """The wire form of ``batch``.

    Raises ValueError or TypeError when a value does not fit its wire type
    (a token id outside uint32, a size outside int64).
    """
    msg = events_pb2.CacheEventBatch(
        instance_id=batch.instance_id,
        incarnation=batch.incarnation,
        seq=batch.seq,
        # Same numbers by design (kvmesh.common.events).
        event_type=events_pb2.CacheEventType.ValueType(batch.event_type),
        tier=common_pb2.Tier.ValueType(batch.tier),
        backend=batch.backend,
        shared=batch.shared,
        ts=batch.ts,
        capacity_bytes=batch.capacity_bytes,
        capacity_revision=batch.capacity_revision,
        traceparent=batch.traceparent,
    )
    add = msg.entries.add
    for entry in batch.entries:
        _fill_entry(entry, add())
    return msg


def _entries_from_proto(
    wire_entries: Iterable[events_pb2.CacheEventEntry], stores: bool
) -> tuple[tuple[CacheEventEntry, ...], bool]:
    """The core form of a batch's entries, and whether they passed the quick entry checks.

    The quick checks are exactly the per-entry conditions of
    :func:`validate_batch` that a wire entry can break (a uint32 ``kv_rank``
    or ``object_group_id`` is always in range): a 32-byte hash, a valid
    model name and salt, ``size_bytes >= 0`` and ``token_offset >= -1``.
    They cost a few comparisons per entry because the model name and salt,
    which repeat across a batch, are validated once per distinct value.
    """
    # Hot loop: tuple.__new__ skips the NamedTuples' Python-level __new__
    # (a frame per key and per entry); locals avoid global lookups; each proto
    # field is read exactly once.
    new = tuple.__new__
    key_cls = ObjectKey
    entry_cls = CacheEventEntry
    unknown = UNKNOWN_TOKEN_OFFSET
    hash_len = CHUNK_HASH_BYTES
    good_model: str | None = None
    good_salt: str | None = None
    clean = True
    entries: list[CacheEventEntry] = []
    append = entries.append
    for wire in wire_entries:
        k = wire.key
        chunk_hash = k.chunk_hash
        model = k.model_name
        salt = k.cache_salt
        size = wire.size_bytes
        tokens = wire.token_ids
        offset = wire.token_offset
        # Absent reads as 0, so presence only needs checking for a 0.
        if not offset and not wire.HasField("token_offset"):
            offset = unknown
        if clean:
            if model != good_model:
                try:
                    validate_model_name(model)
                    good_model = model
                except InvalidArgument:
                    clean = False
            if salt != good_salt:
                try:
                    validate_cache_salt(salt)
                    good_salt = salt
                except InvalidArgument:
                    clean = False
            if len(chunk_hash) != hash_len or size < 0 or offset < unknown:
                clean = False
        segment = None
        if stores and wire.HasField("segment"):  # segment heads ride on STOREs only
            segment = SegmentHead(tuple(wire.segment.head_tokens[:]), wire.segment.num_tokens)
            if not segment_head_ok(segment):
                clean = False
        append(
            new(
                entry_cls,
                (
                    new(key_cls, (chunk_hash, model, k.kv_rank, k.object_group_id, salt)),
                    size,
                    # Slicing copies the repeated field in one call; tuple() over
                    # the container itself iterates it element by element.
                    tuple(tokens[:]) if tokens else (),
                    offset,
                    segment,
                ),
            )
        )
    return tuple(entries), clean


def _entry_template(
    wire: events_pb2.CacheEventEntry, chunk_hash: bytes, stores: bool
) -> tuple[CacheEventEntry, bool]:
    """The core form of one wire entry (with ``chunk_hash``) and whether it passed the checks."""
    k = wire.key
    model = k.model_name
    salt = k.cache_salt
    size = wire.size_bytes
    tokens = wire.token_ids
    offset = wire.token_offset
    if not offset and not wire.HasField("token_offset"):
        offset = UNKNOWN_TOKEN_OFFSET
    segment = _segment_from_proto(wire) if stores else None
    entry = CacheEventEntry(
        ObjectKey(chunk_hash, model, k.kv_rank, k.object_group_id, salt),
        size,
        tuple(tokens[:]) if tokens else (),
        offset,
        segment,
    )
    try:
        validate_model_name(model)
        validate_cache_salt(salt)
    except InvalidArgument:
        return entry, False
    good_segment = segment is None or segment_head_ok(segment)
    return entry, size >= 0 and offset >= UNKNOWN_TOKEN_OFFSET and good_segment


def _convert(
    msg: events_pb2.CacheEventBatch, field: str, *, columns: bool = False
) -> tuple[CacheEventBatch, bool]:
    """The core form of a wire batch and whether its entries passed the quick checks.

    With ``columns`` a batch of entries that differ only in their hashes
    gets :class:`UniformEntries` (the ingest fast path), else a tuple.
    """
    # Members are IntEnums >= 1, so a miss (None) is the only falsy lookup.
    raw_type = msg.event_type
    raw_tier = msg.tier
    event_type = _EVENT_TYPES.get(raw_type) or event_type_from_proto(
        raw_type, f"{field}.event_type"
    )
    tier = _TIERS.get(raw_tier) or tier_from_proto(raw_tier, f"{field}.tier")
    instance_id = msg.instance_id
    incarnation = msg.incarnation
    seq = msg.seq
    backend = msg.backend
    shared = msg.shared
    ts = msg.ts
    capacity_bytes = msg.capacity_bytes
    capacity_revision = msg.capacity_revision
    traceparent = msg.traceparent
    wire_entries = msg.entries
    n = len(wire_entries)
    entries: Sequence[CacheEventEntry] | None = None
    clean = True
    if columns and n >= UNIFORM_MIN_ENTRIES:
        header = events_pb2.CacheEventBatch(
            instance_id=instance_id,
            incarnation=incarnation,
            seq=seq,
            event_type=raw_type,
            tier=raw_tier,
            backend=backend,
            shared=shared,
            ts=ts,
            capacity_bytes=capacity_bytes,
            capacity_revision=capacity_revision,
        ).SerializeToString()
        hashes = uniform_hashes(msg, header, traceparent)
        if hashes is not None:
            stores = event_type is EventType.STORE
            template, clean = _entry_template(wire_entries[0], hashes[0], stores)
            entries = UniformEntries(hashes, template)
    if entries is None:
        entries, clean = _entries_from_proto(wire_entries, event_type is EventType.STORE)
    batch = CacheEventBatch(
        instance_id=instance_id,
        incarnation=incarnation,
        seq=seq,
        event_type=event_type,
        tier=tier,
        backend=backend,
        entries=entries,
        shared=shared,
        ts=ts,
        capacity_bytes=capacity_bytes,
        capacity_revision=capacity_revision,
        traceparent=traceparent,
    )
    return batch, clean


def batch_from_proto(msg: events_pb2.CacheEventBatch, field: str = "batch") -> CacheEventBatch:
    """The core form of a wire batch; ``field`` prefixes the names in errors.

    Raises InvalidArgument only for an ``event_type`` or ``tier`` the core has
    no member for; every other invariant is :func:`validate_batch`'s job (or
    use :func:`validated_batch_from_proto`, which does both in one pass).
    """
    return _convert(msg, field)[0]


def validated_batch_from_proto(
    msg: events_pb2.CacheEventBatch, field: str = "batch"
) -> CacheEventBatch:
    """:func:`batch_from_proto` then :func:`validate_batch`, fused for the ingest hot path.

    Raises exactly what that pair raises, for the same batch: the checks run
    in one pass over the entries (each distinct model name and salt is
    validated once), and only when one of them fails does
    :func:`validate_batch` run to name the first violated invariant.
    """
    batch, clean = _convert(msg, field, columns=True)
    ts = batch.ts
    if (
        clean
        and batch.instance_id
        and batch.incarnation >= 0
        and batch.seq >= 1
        and (batch.backend or batch.event_type is EventType.ACCESS)
        and not (batch.event_type is EventType.CONFIG and batch.entries)
        and batch.capacity_bytes >= 0
        and batch.capacity_revision >= 0
        and 0.0 <= ts <= MAX_EVENT_TS
    ):
        return batch
    validate_batch(batch, field)
    # The quick checks mirror validate_batch's, so this is unreachable; should
    # they ever disagree, the canonical validator's verdict (valid) stands.
    return batch
