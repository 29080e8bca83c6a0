"""The wire converters: cache-event batches, keys, node commands and their results.

Property-style: random valid batches (seeded, so a failure reproduces) must
survive core → proto → bytes → proto → core unchanged and still pass
``validate_batch``; the wire's optional ``token_offset`` keeps 0 apart from
unknown; values the core cannot express are INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import random
import string

import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import (
    batch_from_proto,
    batch_to_proto,
    key_from_proto,
    key_to_proto,
    validated_batch_from_proto,
)
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import (
    MAX_SEGMENT_HEAD,
    UNKNOWN_TOKEN_OFFSET,
    CacheEventBatch,
    CacheEventEntry,
    EventType,
    SegmentHead,
    Tier,
    validate_batch,
)
from kvmesh.common.keys import MAX_CACHE_SALT_CHARS, ObjectKey
from kvmesh.storage.core.ports import DeleteKeysCommand, QuotaChangedCommand, ResyncCommand
from kvmesh.storage.events.codec import (
    UnsupportedCommand,
    command_from_proto,
    result_to_proto,
)
from kvmesh.storage.events.transport import CommandResult
from tests.integration.storage.events.support import key

SEEDS = range(20)
UINT32_MAX = 0xFFFFFFFF
INT64_MAX = (1 << 63) - 1
_SALT_CHARS = string.ascii_letters + string.digits + "-_.:é"
_MODEL_CHARS = string.ascii_letters + string.digits + "-_./:ü"


def random_key(rng: random.Random) -> ObjectKey:
    return ObjectKey(
        chunk_hash=rng.randbytes(32),
        model_name="".join(rng.choices(_MODEL_CHARS, k=rng.randint(1, 40))),
        kv_rank=rng.choice([0, 1, 0x01000100, UINT32_MAX, rng.randint(0, UINT32_MAX)]),
        object_group_id=rng.choice([0, 1, UINT32_MAX]),
        cache_salt=rng.choice(
            ["", "".join(rng.choices(_SALT_CHARS, k=rng.randint(1, MAX_CACHE_SALT_CHARS)))]
        ),
    )


def random_entry(rng: random.Random, event_type: EventType) -> CacheEventEntry:
    tokens: tuple[int, ...] = ()
    if event_type is EventType.STORE and rng.random() < 0.6:
        tokens = tuple(
            rng.choice([0, UINT32_MAX, rng.randint(0, UINT32_MAX)])
            for _ in range(rng.randint(1, 300))
        )
    segment = None
    if event_type is EventType.STORE and rng.random() < 0.3:
        head = tuple(rng.randint(0, UINT32_MAX) for _ in range(rng.randint(1, MAX_SEGMENT_HEAD)))
        segment = SegmentHead(head, rng.choice([len(head), len(head) + 1, UINT32_MAX]))
    return CacheEventEntry(
        key=random_key(rng),
        size_bytes=rng.choice([0, 1, 4 << 20, INT64_MAX]),
        token_ids=tokens,
        token_offset=rng.choice([UNKNOWN_TOKEN_OFFSET, 0, 256, INT64_MAX]),
        segment=segment,
    )


def random_batch(rng: random.Random) -> CacheEventBatch:
    event_type = rng.choice(list(EventType))
    config = event_type is EventType.CONFIG
    backend = "" if event_type is EventType.ACCESS and rng.random() < 0.5 else "dram"
    count = 0 if config else rng.randint(0, 64)
    return CacheEventBatch(
        instance_id=rng.choice(["node-a", "host:8000", "ノード"]),
        incarnation=rng.choice([0, 1, 1_700_000_000_000_000_000, INT64_MAX]),
        seq=rng.choice([1, 2, rng.randint(1, INT64_MAX)]),
        event_type=event_type,
        tier=rng.choice(list(Tier)),
        backend=backend,
        entries=tuple(random_entry(rng, event_type) for _ in range(count)),
        shared=rng.random() < 0.3,
        ts=rng.choice([0.0, 1_700_000_000.123456, rng.random() * 2e9]),
        capacity_bytes=rng.choice([0, 1 << 40, INT64_MAX]) if config else 0,
        capacity_revision=rng.choice([0, 7]) if config else 0,
    )


def through_the_wire(batch: CacheEventBatch) -> CacheEventBatch:
    wire = batch_to_proto(batch).SerializeToString()
    return batch_from_proto(events_pb2.CacheEventBatch.FromString(wire))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_valid_batches_round_trip_unchanged(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(10):
        batch = random_batch(rng)
        validate_batch(batch)
        back = through_the_wire(batch)
        assert back == batch
        validate_batch(back)  # nothing valid is rejected on the way
        assert type(back.event_type) is EventType
        assert type(back.tier) is Tier
        for entry in back.entries:
            assert type(entry) is CacheEventEntry
            assert type(entry.key) is ObjectKey
            assert type(entry.token_ids) is tuple


@pytest.mark.parametrize("seed", SEEDS)
def test_random_wire_batches_round_trip_unchanged(seed: int) -> None:
    rng = random.Random(1000 + seed)
    wire = batch_to_proto(random_batch(rng))
    # Absent and an explicit -1 both mean "unknown"; the canonical form is absent.
    for entry in wire.entries:
        if not entry.HasField("token_offset"):
            entry.token_offset = -1
    again = batch_to_proto(batch_from_proto(wire))
    for entry in again.entries:
        assert not entry.HasField("token_offset") or entry.token_offset >= 0
    assert batch_from_proto(again) == batch_from_proto(wire)


def test_token_offset_zero_is_a_position_and_absent_is_unknown() -> None:
    msg = events_pb2.CacheEventBatch(
        instance_id="n",
        incarnation=1,
        seq=1,
        event_type=events_pb2.CACHE_EVENT_TYPE_STORE,
        tier=common_pb2.TIER_L1,
        backend="dram",
    )
    known = msg.entries.add(token_offset=0)
    known.key.CopyFrom(key_to_proto(key(1)))
    unknown = msg.entries.add()
    unknown.key.CopyFrom(key_to_proto(key(2)))
    explicit = msg.entries.add(token_offset=-1)
    explicit.key.CopyFrom(key_to_proto(key(3)))
    offsets = [e.token_offset for e in batch_from_proto(msg).entries]
    assert offsets == [0, UNKNOWN_TOKEN_OFFSET, UNKNOWN_TOKEN_OFFSET]
    wire = batch_to_proto(batch_from_proto(msg))
    assert [e.HasField("token_offset") for e in wire.entries] == [True, False, False]


@pytest.mark.parametrize(
    "segment",
    [SegmentHead((), 5), SegmentHead((1, 2, 3), 2), SegmentHead(tuple(range(65)), 100)],
)
def test_a_bad_segment_head_is_invalid_argument_naming_the_entry(segment: SegmentHead) -> None:
    bad = CacheEventBatch(
        "n", 1, 1, EventType.STORE, Tier.L1, "dram", (CacheEventEntry(key(1), 1, segment=segment),)
    )
    wire = batch_to_proto(bad)
    assert wire.entries[0].HasField("segment")  # an empty head still says "a segment"
    with pytest.raises(InvalidArgument, match=r"entries\[0\]\.segment"):
        validated_batch_from_proto(wire)


def test_invalid_values_still_cross_so_the_coordinator_can_name_them() -> None:
    bad = CacheEventBatch(
        "n", 1, 1, EventType.STORE, Tier.L1, "dram", (CacheEventEntry(key(1), -5, (), -7),)
    )
    back = through_the_wire(bad)
    assert back == bad
    with pytest.raises(InvalidArgument) as err:
        validate_batch(back)
    assert err.value.field == "batch.entries[0].size_bytes"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"event_type": events_pb2.CACHE_EVENT_TYPE_UNSPECIFIED}, "batches[3].event_type"),
        ({"event_type": 99}, "batches[3].event_type"),
        ({"tier": common_pb2.TIER_UNSPECIFIED}, "batches[3].tier"),
        ({"tier": common_pb2.TIER_ALL}, "batches[3].tier"),
    ],
)
def test_enum_values_the_core_lacks_are_invalid_argument_naming_the_field(
    changes: dict[str, int], field: str
) -> None:
    msg = events_pb2.CacheEventBatch(
        instance_id="n",
        incarnation=1,
        seq=1,
        event_type=events_pb2.CACHE_EVENT_TYPE_STORE,
        tier=common_pb2.TIER_L1,
        backend="dram",
    )
    for name, value in changes.items():
        setattr(msg, name, value)
    with pytest.raises(InvalidArgument) as err:
        batch_from_proto(msg, "batches[3]")
    assert err.value.field == field


def test_token_ids_outside_uint32_do_not_fit_the_wire() -> None:
    for tokens in [(-1,), (1 << 32,)]:
        batch = CacheEventBatch(
            "n", 1, 1, EventType.STORE, Tier.L1, "dram", (CacheEventEntry(key(1), 1, tokens),)
        )
        with pytest.raises(ValueError, match="out of range"):
            batch_to_proto(batch)


@pytest.mark.parametrize("seed", range(5))
def test_keys_round_trip(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        k = random_key(rng)
        wire = common_pb2.ObjectKey.FromString(key_to_proto(k).SerializeToString())
        assert key_from_proto(wire) == k


# ---------------------------------------------------------------------------- commands


def test_delete_keys_command_converts_with_its_keys_in_order() -> None:
    keys = [key(3), key(1, salt="tenant"), key(2)]
    msg = ingest_pb2.NodeCommand(
        command_id="c1",
        delete_keys=ingest_pb2.DeleteKeysCommand(
            tier=common_pb2.TIER_L1, backend="", keys=[key_to_proto(k) for k in keys], force=True
        ),
    )
    assert command_from_proto(msg) == DeleteKeysCommand("c1", Tier.L1, "", tuple(keys), True)


def test_resync_and_quota_commands_convert() -> None:
    resync = ingest_pb2.NodeCommand(
        command_id="r", resync=ingest_pb2.ResyncCommand(tier=common_pb2.TIER_L2)
    )
    assert command_from_proto(resync) == ResyncCommand("r", Tier.L2)
    limit = ingest_pb2.NodeCommand(
        command_id="q",
        set_quota=ingest_pb2.SetQuotaCommand(
            cache_salt="t", tier=common_pb2.TIER_L1, limit_bytes=1 << 40
        ),
    )
    assert command_from_proto(limit) == QuotaChangedCommand("q", "t", Tier.L1, 1 << 40)
    no_limit = ingest_pb2.SetQuotaCommand(cache_salt="", tier=common_pb2.TIER_L2)
    removed = ingest_pb2.NodeCommand(command_id="q2", set_quota=no_limit)
    assert command_from_proto(removed) == QuotaChangedCommand("q2", "", Tier.L2, None)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (
            ingest_pb2.NodeCommand(
                delete_keys=ingest_pb2.DeleteKeysCommand(tier=common_pb2.TIER_ALL)
            ),
            "command.delete_keys.tier",
        ),
        (
            ingest_pb2.NodeCommand(
                delete_keys=ingest_pb2.DeleteKeysCommand(
                    tier=common_pb2.TIER_L2,
                    keys=[key_to_proto(key(1)), common_pb2.ObjectKey(chunk_hash=b"x")],
                )
            ),
            "command.delete_keys.keys[1].chunk_hash",
        ),
        (ingest_pb2.NodeCommand(resync=ingest_pb2.ResyncCommand()), "command.resync.tier"),
        (
            ingest_pb2.NodeCommand(
                set_quota=ingest_pb2.SetQuotaCommand(cache_salt="a/b", tier=common_pb2.TIER_L2)
            ),
            "command.set_quota.cache_salt",
        ),
    ],
)
def test_commands_the_node_cannot_express_are_invalid_argument(
    msg: ingest_pb2.NodeCommand, field: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        command_from_proto(msg)
    assert err.value.field == field


def test_a_zero_byte_quota_is_a_real_quota() -> None:
    msg = ingest_pb2.NodeCommand(
        command_id="z", set_quota=ingest_pb2.SetQuotaCommand(tier=common_pb2.TIER_L2, limit_bytes=0)
    )
    assert command_from_proto(msg) == QuotaChangedCommand("z", "", Tier.L2, 0)


def test_a_command_of_unknown_kind_is_unimplemented() -> None:
    with pytest.raises(UnsupportedCommand) as err:
        command_from_proto(ingest_pb2.NodeCommand(command_id="x"))
    assert err.value.code == "UNIMPLEMENTED"


def test_command_results_convert_field_by_field() -> None:
    wire = result_to_proto(
        CommandResult("c", "NOT_FOUND", "no backend nvme", affected=3, effects_through_seq=41)
    )
    assert wire == ingest_pb2.CommandResult(
        command_id="c",
        code="NOT_FOUND",
        message="no backend nvme",
        affected=3,
        effects_through_seq=41,
    )
    assert result_to_proto(CommandResult("c", affected=1 << 40)).affected == UINT32_MAX
