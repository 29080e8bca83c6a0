"""A blending engine's segments in a real storage node: position-independent keys, exact bytes."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvmesh.engine.llama import SequenceKV
from kvmesh.engine.segment_store import SegmentStore, segment_key
from kvmesh.kernels.rope import RopeParams, apply_rope
from tests.integration.storage.conftest import NodeFactory

LAYERS, HEADS, HEAD_DIM = 3, 2, 16
ROPE = RopeParams(head_dim=HEAD_DIM, base=10000.0)


def _segment(rows: int, start: int, seed: int) -> tuple[SequenceKV, list[torch.Tensor]]:
    """K/V of ``rows`` tokens whose keys were roped at ``start``..; also the raw keys."""
    g = torch.Generator().manual_seed(seed)
    raw = [torch.randn(rows, HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(rows, HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    at = torch.arange(start, start + rows)
    return SequenceKV([apply_rope(k, at, ROPE) for k in raw], values), raw


def _store(target: str, **kw: object) -> SegmentStore:
    return SegmentStore(target, "m", ROPE, num_layers=LAYERS, kv_heads=HEADS, **kw)  # type: ignore[arg-type]


def test_a_segment_computed_anywhere_is_found_by_its_tokens_with_keys_at_zero(
    make_node: NodeFactory,
) -> None:
    node = make_node()
    tokens = list(range(1000, 1037))
    kv, raw = _segment(len(tokens), start=500, seed=1)
    with _store(node.server.target) as store:
        assert store.get(tokens) is None
        assert store.put(tokens, kv, source_start=500) is True
        assert store.put(tokens, kv, source_start=500) is False  # there already
        got = store.get(tokens)
        assert got is not None
        assert len(got) == len(tokens)
        zero = torch.arange(len(tokens))
        for layer in range(LAYERS):
            torch.testing.assert_close(got.keys[layer], apply_rope(raw[layer], zero, ROPE))
            assert torch.equal(got.values[layer], kv.values[layer])
        assert store.get(tokens[:-1]) is None  # other tokens, another key
        assert node.read_locked_objects() == 0  # every read released its lock


def test_keys_name_the_model_and_tokens_only() -> None:
    assert segment_key("m", [1, 2, 3]) == segment_key("m", [1, 2, 3])
    assert segment_key("m", [1, 2, 3]) != segment_key("m", [1, 2, 4])
    assert segment_key("m", [1, 2, 3]) != segment_key("n", [1, 2, 3])
    assert len(segment_key("m", [])) == 32


def test_salts_keep_segments_apart(make_node: NodeFactory) -> None:
    node = make_node()
    tokens = [5] * 20
    kv, _ = _segment(20, start=0, seed=2)
    target = node.server.target
    with _store(target, cache_salt="a") as a, _store(target, cache_salt="b") as b:
        a.put(tokens, kv, source_start=0)
        assert a.get(tokens) is not None
        assert b.get(tokens) is None


def test_bad_segments_are_refused_and_a_full_node_says_so(make_node: NodeFactory) -> None:
    node = make_node(l1_size_bytes=1 << 20, l1_segment_bytes=1 << 20)
    with _store(node.server.target) as store:
        kv, _ = _segment(10, start=0, seed=3)
        with pytest.raises(ValueError, match="3 layers x 10 rows for 11 tokens"):
            store.put(list(range(11)), kv, source_start=0)
        big, _ = _segment(4000, start=0, seed=4)  # 3 MiB: more than the node's whole L1
        with pytest.raises(grpc.RpcError) as info:
            store.put(list(range(4000)), big, source_start=0)
        assert info.value.code() in (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.INVALID_ARGUMENT,
        ), info.value
        assert store.get(list(range(4000))) is None
