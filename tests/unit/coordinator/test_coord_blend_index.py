"""The fleet's blend index (coordinator.core.blendindex), fed by STORE batches as the gate
delivers them, with the real key directory behind it."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.common.errors import FailedPrecondition, InvalidArgument
from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, SegmentHead, Tier
from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.coordinator.core import Coordinator, CoordinatorSettings
from tests.unit.coordinator.coord_testkit import Stream

MODEL = "m"


def make(**kw: object) -> Coordinator:
    base: dict[str, object] = {
        "health_check_interval": 0,
        "eviction_check_interval": 0,
        "enable_blend_lookup": True,
    }
    base.update(kw)
    return Coordinator(CoordinatorSettings(**base))  # type: ignore[arg-type]


def doc(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def seg_key(tokens: list[int], *, rank: int = 0, world: int = 1, salt: str = "") -> ObjectKey:
    return ObjectKey(segment_key(MODEL, tokens), MODEL, worker_kv_rank(world, rank), 0, salt)


def store(stream: Stream, keys: list[ObjectKey], tokens: list[int]) -> CacheEventBatch:
    head = SegmentHead(tuple(tokens[:16]), len(tokens))
    stream.seq += 1
    return CacheEventBatch(
        stream.instance_id, stream.incarnation, stream.seq, EventType.STORE, Tier.L1, "dram",
        tuple(CacheEventEntry(k, 4096, segment=head) for k in keys),
    )  # fmt: skip


def found(
    c: Coordinator, prompt: list[int], *, world: int = 1, salt: str = "", stride: int = 0
) -> list[tuple[int, int]]:
    matches, _ = c.blend_lookup(MODEL, world, salt, prompt, stride)
    return [(m.start, m.length) for m in matches]


def test_a_segment_stored_on_a_node_is_found_anywhere_with_its_placements() -> None:
    c = make()
    a, b = doc(1000, 40), doc(2000, 20)
    node = Stream("node-a")
    c.ingest(store(node, [seg_key(a)], a))
    c.ingest(store(node, [seg_key(b)], b))
    prompt = [*doc(1, 5), *b, 7, *a, 9]
    matches, probed = c.blend_lookup(MODEL, 1, "", prompt)
    assert [(m.start, m.length) for m in matches] == [(5, 20), (26, 40)]
    assert matches[0].chunk_hash == segment_key(MODEL, b)
    assert [p.instance_id for p in matches[1].ranks[0].placements] == ["node-a"]
    assert probed > 0
    assert found(c, prompt, stride=2) == [(26, 40)]  # 5 is off the stride
    assert found(c, prompt, salt="other") == []
    assert found(c, [*a[1:], 3]) == []  # not at its start


def test_segments_with_the_same_start_and_length_are_each_found() -> None:
    """A system prompt followed by one document or another: one head, one length."""
    c = make()
    system = doc(1, 20)
    a, b = [*system, *doc(100, 30)], [*system, *doc(200, 30)]
    node = Stream("node-a")
    c.ingest(store(node, [seg_key(a)], a))
    c.ingest(store(node, [seg_key(b)], b))
    assert len(c.blend) == 2
    assert found(c, [*a, 7]) == [(0, 50)]
    assert found(c, [*b, 7]) == [(0, 50)]
    c.ingest(node.delete([seg_key(a)]))
    assert found(c, [*a, 7]) == []
    assert found(c, [*b, 7]) == [(0, 50)]  # forgetting one kept the other
    assert len(c.blend) == 1


def test_every_kv_rank_must_be_held_and_a_segment_no_node_holds_is_forgotten() -> None:
    c = make()
    a = doc(500, 32)
    node = Stream("node-a")
    c.ingest(store(node, [seg_key(a, rank=0, world=2)], a))
    assert found(c, a, world=2) == []  # rank 1 is held nowhere
    c.ingest(store(node, [seg_key(a, rank=1, world=2)], a))
    assert found(c, a, world=2) == [(0, 32)]
    c.ingest(node.delete([seg_key(a, rank=0, world=2), seg_key(a, rank=1, world=2)]))
    assert found(c, a, world=2) == []
    assert len(c.blend) == 0


def test_a_fenced_node_no_longer_serves_its_segments() -> None:
    c = make()
    a = doc(10, 16)
    c.ingest(store(Stream("node-a"), [seg_key(a)], a))
    assert found(c, a) == [(0, 16)]
    c.gate.drop_instance("node-a")
    c.directory.reclaim_fenced()
    assert found(c, a) == []


def test_the_index_is_off_unless_enabled_and_says_how_to_turn_it_on() -> None:
    c = make(enable_blend_lookup=False)
    a = doc(10, 16)
    c.ingest(store(Stream("node-a"), [seg_key(a)], a))
    with pytest.raises(FailedPrecondition, match="--enable-blend-lookup"):
        c.blend_lookup(MODEL, 1, "", a)
    assert len(c.blend) == 0


def test_bad_segment_heads_are_refused_at_ingest() -> None:
    c = make()
    bad = CacheEventBatch(
        "node-a", 1, 1, EventType.STORE, Tier.L1, "dram",
        (CacheEventEntry(seg_key(doc(1, 20)), 1, segment=SegmentHead((1, 2, 3), 2)),),
    )  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"entries\[0\]\.segment"):
        c.ingest_batches([bad])
    assert len(c.blend) == 0


def test_a_prompt_too_long_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="tokens"):
        make().blend_lookup(MODEL, 1, "", np.zeros((1 << 20) + 1, dtype=np.uint32))
