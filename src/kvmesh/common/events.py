"""Cache events in plain Python: what a storage node reports and the coordinator ingests.

These mirror ``kvmesh.events.v1`` (the enum values are the proto numbers, so
conversion is ``int()``), with LMCache's invariants (docs/events.md) enforced
by :func:`validate_batch`. The emitter builds them, the coordinator's gate and
consumers read them; only the servicers convert to and from protobuf.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey, validate_object_key

UNKNOWN_TOKEN_OFFSET = -1
#: The latest event time accepted (seconds since the epoch): 9999-12-31T23:59:59Z.
MAX_EVENT_TS = 253_402_300_799.0


class Tier(enum.IntEnum):
    """Storage tier of a placement (``kvmesh.common.v1.Tier``)."""

    L1 = 1
    L2 = 2


class EventType(enum.IntEnum):
    """What happened to every entry of a batch (``kvmesh.events.v1.CacheEventType``)."""

    STORE = 1
    DELETE = 2
    ACCESS = 3
    CONFIG = 4


class IngestResult(enum.IntEnum):
    """The gate's verdict on one batch (``kvmesh.events.v1.IngestResult``)."""

    ADMITTED = 1
    DUPLICATE = 2
    STALE_INCARNATION = 3


class CacheEventEntry(NamedTuple):
    """One key inside a batch.

    ``size_bytes`` matters for STORE only; ``token_ids``/``token_offset`` are
    the chunk's tokens and the position of its first token when the emitter
    still knows them (offset -1 = unknown; 0 is a real position).
    """

    key: ObjectKey
    size_bytes: int = 0
    token_ids: Sequence[int] = ()
    token_offset: int = UNKNOWN_TOKEN_OFFSET
    #: A CacheBlend segment's first tokens and length (None: not a segment).
    segment: SegmentHead | None = None


#: Most head tokens one segment entry carries.
MAX_SEGMENT_HEAD = 64


class SegmentHead(NamedTuple):
    """A CacheBlend segment's first tokens and its length (docs/blend.md)."""

    head_tokens: tuple[int, ...]
    num_tokens: int


def segment_head_ok(segment: SegmentHead) -> bool:
    """Whether ``segment`` has 1..min(num_tokens, MAX_SEGMENT_HEAD) head tokens."""
    return 0 < len(segment.head_tokens) <= min(segment.num_tokens, MAX_SEGMENT_HEAD)


@dataclass(frozen=True, slots=True)
class CacheEventBatch:
    """A run of entries of one event type from one emitter, tier and backend."""

    instance_id: str
    incarnation: int
    seq: int
    event_type: EventType
    tier: Tier
    backend: str
    entries: Sequence[CacheEventEntry] = field(default_factory=tuple)
    shared: bool = False
    ts: float = 0.0
    capacity_bytes: int = 0
    capacity_revision: int = 0
    # W3C trace context of the change that opened the batch ("" = not traced).
    traceparent: str = ""

    def ident(self) -> str:
        """``instance/incarnation/seq`` for log lines."""
        return f"{self.instance_id}/{self.incarnation}/{self.seq}"


def validate_batch(batch: CacheEventBatch, field_prefix: str = "batch") -> None:
    """Raise InvalidArgument naming the first violated invariant of ``batch``.

    Checks, in order: instance_id non-empty; incarnation >= 0; seq >= 1;
    event_type known; tier is L1 or L2; backend non-empty unless ACCESS;
    CONFIG carries no entries; capacity_bytes and capacity_revision >= 0;
    ts >= 0 and finite; every entry's key valid, size_bytes >= 0,
    token_offset >= 0 or -1, and a segment head of 1..min(num_tokens, 64) tokens.
    """
    p = field_prefix
    if not batch.instance_id:
        raise InvalidArgument(f"{p}.instance_id must not be empty", field=f"{p}.instance_id")
    if batch.incarnation < 0:
        raise InvalidArgument(f"{p}.incarnation must be >= 0", field=f"{p}.incarnation")
    if batch.seq < 1:
        raise InvalidArgument(f"{p}.seq must be >= 1, got {batch.seq}", field=f"{p}.seq")
    try:
        event_type = EventType(batch.event_type)
    except ValueError:
        raise InvalidArgument(
            f"{p}.event_type {batch.event_type!r} is not a known event type",
            field=f"{p}.event_type",
        ) from None
    if batch.tier not in (Tier.L1, Tier.L2):
        raise InvalidArgument(
            f"{p}.tier must be a concrete tier (L1 or L2), got {batch.tier!r}",
            field=f"{p}.tier",
        )
    if not batch.backend and event_type is not EventType.ACCESS:
        raise InvalidArgument(
            f"{p}.backend must not be empty for {event_type.name}", field=f"{p}.backend"
        )
    if event_type is EventType.CONFIG and len(batch.entries) > 0:
        raise InvalidArgument(f"{p}.entries must be empty for CONFIG", field=f"{p}.entries")
    if batch.capacity_bytes < 0:
        raise InvalidArgument(f"{p}.capacity_bytes must be >= 0", field=f"{p}.capacity_bytes")
    if batch.capacity_revision < 0:
        raise InvalidArgument(f"{p}.capacity_revision must be >= 0", field=f"{p}.capacity_revision")
    if not 0.0 <= batch.ts <= MAX_EVENT_TS:
        # Seconds since the epoch; a larger one (milliseconds, say) would be kept as a
        # key's last access, which no timestamp message can carry back.
        raise InvalidArgument(
            f"{p}.ts must be seconds since the epoch, in [0, {MAX_EVENT_TS:.0f}]",
            field=f"{p}.ts",
        )
    for i, entry in enumerate(batch.entries):
        ep = f"{p}.entries[{i}]"
        validate_object_key(entry.key, field=f"{ep}.key")
        if entry.size_bytes < 0:
            raise InvalidArgument(f"{ep}.size_bytes must be >= 0", field=f"{ep}.size_bytes")
        if entry.token_offset < UNKNOWN_TOKEN_OFFSET:
            raise InvalidArgument(
                f"{ep}.token_offset must be >= 0 or -1 (unknown)", field=f"{ep}.token_offset"
            )
        if entry.segment is not None and not segment_head_ok(entry.segment):
            raise InvalidArgument(
                f"{ep}.segment must have 1..min(num_tokens, {MAX_SEGMENT_HEAD}) head tokens",
                field=f"{ep}.segment",
            )
