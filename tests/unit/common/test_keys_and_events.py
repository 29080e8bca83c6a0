"""ObjectKey rules and cache-event batch invariants."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import (
    CacheEventBatch,
    CacheEventEntry,
    EventType,
    Tier,
    validate_batch,
)
from kvmesh.common.keys import (
    ObjectKey,
    object_name,
    pack_kv_rank,
    parse_object_name,
    validate_object_key,
    worker_kv_rank,
)

HASH = bytes(range(32))


def test_kv_rank_packing_matches_lmcache_examples() -> None:
    assert worker_kv_rank(1, 0) == 0x01000100
    assert worker_kv_rank(4, 2) == 0x04020402
    assert pack_kv_rank(8, 3, 8, 3) == 0x08030803


def test_kv_rank_parts_must_fit() -> None:
    with pytest.raises(InvalidArgument):
        worker_kv_rank(2, 2)
    with pytest.raises(InvalidArgument):
        pack_kv_rank(256, 0, 1, 0)


@pytest.mark.parametrize(
    ("key", "field"),
    [
        (ObjectKey(b"short", "m", 1), "key.chunk_hash"),
        (ObjectKey(HASH, "", 1), "key.model_name"),
        (ObjectKey(HASH, "a@b", 1), "key.model_name"),
        (ObjectKey(HASH, "m", 1, 0, "x@y"), "key.cache_salt"),
        (ObjectKey(HASH, "m", 1, 0, "x/y"), "key.cache_salt"),
        (ObjectKey(HASH, "m", 1, 0, "x\\y"), "key.cache_salt"),
        (ObjectKey(HASH, "m", 1, 0, "x\0y"), "key.cache_salt"),
        (ObjectKey(HASH, "m", 1, 0, "s" * 129), "key.cache_salt"),
        (ObjectKey(HASH, "m", -1), "key.kv_rank"),
        (ObjectKey(HASH, "m", 1, -1), "key.object_group_id"),
    ],
)
def test_invalid_keys_name_the_bad_field(key: ObjectKey, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_object_key(key)
    assert err.value.field == field


def test_object_names_round_trip_and_keep_salt_and_slashes() -> None:
    key = ObjectKey(HASH, "org/model-7b", worker_kv_rank(2, 1), 3, "tenant")
    name = object_name(key)
    assert "/" not in name
    assert parse_object_name(name) == key
    assert parse_object_name(object_name(key._replace(cache_salt=""))).cache_salt == ""


@pytest.mark.parametrize("name", ["x", "a@b@c", "m@zz@0@00", "m@00000001@0@abcd"])
def test_foreign_object_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_object_name(name)


def _batch(**changes: object) -> CacheEventBatch:
    base = CacheEventBatch(
        instance_id="node-a",
        incarnation=1,
        seq=1,
        event_type=EventType.STORE,
        tier=Tier.L1,
        backend="dram",
        entries=(CacheEventEntry(ObjectKey(HASH, "m", 1), 10),),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_a_valid_batch_passes() -> None:
    validate_batch(_batch())
    validate_batch(_batch(event_type=EventType.ACCESS, backend=""))
    validate_batch(_batch(event_type=EventType.CONFIG, entries=(), capacity_bytes=5))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"instance_id": ""}, "batch.instance_id"),
        ({"backend": ""}, "batch.backend"),
        ({"event_type": EventType.DELETE, "backend": ""}, "batch.backend"),
        ({"event_type": EventType.CONFIG}, "batch.entries"),
        ({"capacity_bytes": -1}, "batch.capacity_bytes"),
        ({"capacity_revision": -1}, "batch.capacity_revision"),
        ({"incarnation": -1}, "batch.incarnation"),
        ({"seq": 0}, "batch.seq"),
        ({"tier": 3}, "batch.tier"),
        ({"ts": -1.0}, "batch.ts"),
        ({"ts": float("nan")}, "batch.ts"),
        ({"ts": 1.7e12}, "batch.ts"),
        ({"event_type": 0}, "batch.event_type"),
        (
            {"entries": (CacheEventEntry(ObjectKey(HASH, "m", 1), -1),)},
            "batch.entries[0].size_bytes",
        ),
        (
            {"entries": (CacheEventEntry(ObjectKey(HASH, "m", 1), 1, (), -2),)},
            "batch.entries[0].token_offset",
        ),
        (
            {"entries": (CacheEventEntry(ObjectKey(b"x", "m", 1)),)},
            "batch.entries[0].key.chunk_hash",
        ),
    ],
)
def test_each_batch_invariant_is_enforced(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_batch(_batch(**changes))
    assert err.value.field == field


def test_validating_many_keys_checks_every_key_even_with_shared_names() -> None:
    from kvmesh.common.keys import validate_object_keys

    good = [ObjectKey(HASH, "m", 1, 0, "s") for _ in range(3)]
    validate_object_keys(good)
    for bad, field in (
        (ObjectKey(b"x", "m", 1, 0, "s"), "keys[1].chunk_hash"),
        (ObjectKey(HASH, "m", -1, 0, "s"), "keys[1].kv_rank"),
        (ObjectKey(HASH, "m@x", 1, 0, "s"), "keys[1].model_name"),
        (ObjectKey(HASH, "m", 1, 0, "a/b"), "keys[1].cache_salt"),
    ):
        with pytest.raises(InvalidArgument) as err:
            validate_object_keys([good[0], bad, good[2]])
        assert err.value.field == field
