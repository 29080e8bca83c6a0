"""``validated_batch_from_proto`` (the ingest hot path) behaves exactly like its two halves.

For thousands of random wire batches, valid or broken in one or several
fields at once (so the order in which invariants are checked matters), the
fused function returns the same batch as ``batch_from_proto`` followed by
``validate_batch``, or raises InvalidArgument with the same field and message.
No sockets: this pins the servicer's conversion, which every test of this
directory then exercises over gRPC.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import batch_from_proto, validated_batch_from_proto
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import CacheEventBatch, validate_batch

Breaker = Callable[[events_pb2.CacheEventBatch, random.Random], None]


def _entry_field(rng: random.Random, msg: events_pb2.CacheEventBatch) -> events_pb2.CacheEventEntry:
    if not msg.entries:
        msg.entries.add(key=_key(rng), size_bytes=1)
    return msg.entries[rng.randrange(len(msg.entries))]


def _key(rng: random.Random, model: str = "org/m", salt: str = "") -> common_pb2.ObjectKey:
    return common_pb2.ObjectKey(
        chunk_hash=rng.randbytes(32),
        model_name=model,
        kv_rank=rng.choice([0, 0x01000100, 0xFFFFFFFF]),
        object_group_id=rng.choice([0, 1, 0xFFFFFFFF]),
        cache_salt=salt,
    )


BREAKERS: list[Breaker] = [
    lambda m, r: setattr(m, "instance_id", ""),
    lambda m, r: setattr(m, "incarnation", -r.randint(1, 5)),
    lambda m, r: setattr(m, "seq", -r.randint(0, 3)),
    lambda m, r: setattr(m, "event_type", r.choice([0, 9])),
    lambda m, r: setattr(m, "tier", r.choice([0, 3, 7])),
    lambda m, r: setattr(m, "backend", ""),
    lambda m, r: setattr(m, "event_type", events_pb2.CACHE_EVENT_TYPE_CONFIG),
    lambda m, r: setattr(m, "capacity_bytes", -1),
    lambda m, r: setattr(m, "capacity_revision", -2),
    lambda m, r: setattr(m, "ts", r.choice([-1.0, math.nan, math.inf, -math.inf])),
    lambda m, r: setattr(_entry_field(r, m).key, "chunk_hash", r.randbytes(r.choice([0, 31, 33]))),
    lambda m, r: setattr(_entry_field(r, m).key, "model_name", r.choice(["", "a@b", "x" * 513])),
    lambda m, r: setattr(_entry_field(r, m).key, "cache_salt", r.choice(["a/b", "@", "s" * 129])),
    lambda m, r: setattr(_entry_field(r, m), "size_bytes", -r.randint(1, 9)),
    lambda m, r: setattr(_entry_field(r, m), "token_offset", -r.randint(2, 9)),
]


def _valid(rng: random.Random) -> events_pb2.CacheEventBatch:
    event_type = rng.choice([1, 2, 3])
    msg = events_pb2.CacheEventBatch(
        instance_id=rng.choice(["node-a", "n"]),
        incarnation=rng.randint(0, 3),
        seq=rng.randint(1, 9),
        event_type=event_type,  # type: ignore[arg-type]
        tier=rng.choice([1, 2]),  # type: ignore[arg-type]
        backend="" if event_type == 3 and rng.random() < 0.5 else "disk",
        shared=rng.random() < 0.2,
        ts=rng.choice([0.0, 1.7e9]),
    )
    models = ["org/m", "other"]
    salts = ["", "t1"]
    for _ in range(rng.randint(0, 6)):
        e = msg.entries.add(
            key=_key(rng, rng.choice(models), rng.choice(salts)), size_bytes=rng.randint(0, 9)
        )
        if rng.random() < 0.3:
            e.token_ids.extend(rng.randint(0, 2**32 - 1) for _ in range(4))
        if rng.random() < 0.5:
            e.token_offset = rng.choice([-1, 0, 4, 512])
    return msg


def _outcome(fn: Callable[[], CacheEventBatch]) -> tuple[str, object]:
    try:
        return "ok", fn()
    except InvalidArgument as exc:
        return "error", (exc.field, exc.message)


def _reference(msg: events_pb2.CacheEventBatch) -> CacheEventBatch:
    batch = batch_from_proto(msg, "batches[3]")
    validate_batch(batch, "batches[3]")
    return batch


@pytest.mark.parametrize("seed", range(8))
def test_fused_conversion_matches_convert_then_validate(seed: int) -> None:
    rng = random.Random(seed)
    errors = 0
    for _ in range(600):
        msg = _valid(rng)
        for breaker in rng.sample(BREAKERS, rng.choice([0, 0, 1, 1, 2, 3])):
            breaker(msg, rng)
        expected = _outcome(lambda m=msg: _reference(m))  # type: ignore[misc]
        got = _outcome(lambda m=msg: validated_batch_from_proto(m, "batches[3]"))  # type: ignore[misc]
        assert got == expected, msg
        errors += expected[0] == "error"
    assert 100 < errors < 600  # both outcomes were exercised


def test_a_bad_model_after_good_entries_is_still_found() -> None:
    rng = random.Random(1)
    msg = _valid(rng)
    msg.event_type = events_pb2.CACHE_EVENT_TYPE_STORE
    msg.backend = "disk"
    del msg.entries[:]
    for i in range(5):
        msg.entries.add(key=_key(rng), size_bytes=i)
    msg.entries[3].key.model_name = "org/m@x"
    with pytest.raises(InvalidArgument) as info:
        validated_batch_from_proto(msg, "batch")
    assert info.value.field == "batch.entries[3].key.model_name"
