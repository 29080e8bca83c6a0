"""The uniform fast path of ``validated_batch_from_proto`` on (near-)uniform batches.

A batch whose entries differ only in their chunk hash comes back as
UniformEntries (columns); any other is converted entry by entry. Either way
the result equals ``batch_from_proto`` + ``validate_batch`` (or raises the
same error): one mutated field anywhere, an unknown field, a traceparent,
long varints, must never let a wrong column through.
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
from kvmesh.common.uniform_batches import UniformEntries

Mutation = Callable[[events_pb2.CacheEventEntry, random.Random], object]

MUTATIONS: list[Mutation] = [
    lambda e, r: setattr(e, "size_bytes", r.choice([0, 1, 4 << 20, 2**40, -1])),
    lambda e, r: setattr(e.key, "model_name", r.choice(["m", "org/m2", "", "a@b", "é" * 3])),
    lambda e, r: setattr(e.key, "cache_salt", r.choice(["", "t2", "a/b"])),
    lambda e, r: setattr(e.key, "kv_rank", r.choice([0, 1, 0xFFFFFFFF])),
    lambda e, r: setattr(e.key, "object_group_id", r.choice([0, 1, 300])),
    lambda e, r: setattr(e.key, "chunk_hash", r.randbytes(r.choice([0, 31, 33, 32]))),
    lambda e, r: e.token_ids.append(r.randint(0, 2**32 - 1)),
    lambda e, r: setattr(e, "token_offset", r.choice([-1, 0, 5, -3])),
    lambda e, r: e.ClearField("token_offset"),
    lambda e, r: e.ClearField("key"),
    lambda e, r: e.MergeFromString(b"\xa8\x06\x01"),  # an unknown field (101)
]


def _batch(r: random.Random) -> events_pb2.CacheEventBatch:
    msg = events_pb2.CacheEventBatch(
        instance_id=r.choice(["node-a", "é"]),
        incarnation=r.choice([0, 1, 2**40]),
        seq=r.choice([1, 5, 2**50]),
        event_type=r.choice([1, 2, 3]),  # type: ignore[arg-type]
        tier=r.choice([1, 2]),  # type: ignore[arg-type]
        backend=r.choice(["fs", "dram"]),
        shared=r.random() < 0.3,
        ts=r.choice([0.0, 1.7e9, -0.0, math.nan if r.random() < 0.05 else 1.0]),
        traceparent=r.choice(["", "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "é" * 70]),
    )
    model = r.choice(["org/m", "x" * r.choice([100, 200, 511])])
    salt = r.choice(["", "tenant-a"])
    rank, group = r.choice([0, 0x01000100, 0xFFFFFFFF]), r.choice([0, 1, 0xFFFFFFFF])
    size = r.choice([0, 127, 128, 4 << 20, 2**62])
    tokens = [r.randint(0, 2**32 - 1) for _ in range(r.choice([0, 0, 3]))]
    offset = r.choice([None, -1, 0, 256])
    for _ in range(r.choice([6, 8, 64, 130])):
        key = common_pb2.ObjectKey(
            chunk_hash=r.randbytes(32),
            model_name=model,
            kv_rank=rank,
            object_group_id=group,
            cache_salt=salt,
        )
        e = msg.entries.add(key=key, size_bytes=size, token_ids=tokens)
        if offset is not None:
            e.token_offset = offset
    for _ in range(r.choice([0, 0, 1, 2])):
        r.choice(MUTATIONS)(msg.entries[r.randrange(len(msg.entries))], r)
    if r.random() < 0.05:
        msg.MergeFromString(b"\xa8\x06\x01")
    return msg


def _outcome(msg: events_pb2.CacheEventBatch, fused: bool) -> tuple[str, object]:
    try:
        if fused:
            return "ok", validated_batch_from_proto(msg, "b")
        batch = batch_from_proto(msg, "b")
        validate_batch(batch, "b")
        return "ok", batch
    except InvalidArgument as exc:
        return "error", (exc.field, exc.message)


@pytest.mark.parametrize("seed", range(4))
def test_uniform_columns_equal_the_entry_by_entry_conversion(seed: int) -> None:
    r = random.Random(seed)
    columns = 0
    for _ in range(1500):
        msg = _batch(r)
        expected = _outcome(msg, fused=False)
        got = _outcome(msg, fused=True)
        assert got == expected, msg
        if got[0] != "ok":
            continue
        batch, reference = got[1], expected[1]
        assert isinstance(batch, CacheEventBatch)
        assert isinstance(reference, CacheEventBatch)
        if isinstance(batch.entries, UniformEntries):
            columns += 1
            assert list(batch.entries.chunk_hashes) == [e.key.chunk_hash for e in reference.entries]
            assert hash(batch.entries) == hash(tuple(reference.entries))
    assert columns > 200  # the fast path was taken
