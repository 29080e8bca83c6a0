"""CacheBlend segments through a real gateway and node: keys of the tokens alone, exact bytes.

The blending engine's :class:`SegmentStore` registers an engine-driven context,
writes each segment's object into the slot ``PrepareSegmentStore`` hands out
and reads it back through ``PrepareSegmentRetrieve``. Marked ``transports``:
it runs over gRPC to two servers, one ``kvmesh node``, and the local lane.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
import torch

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import worker_kv_rank
from kvmesh.engine import segment_store
from kvmesh.engine.llama import SequenceKV
from kvmesh.engine.segment_store import SegmentStore
from kvmesh.kernels.rope import RopeParams, apply_rope
from tests.integration.gateway.conftest import StackFactory
from tests.integration.gateway.support import MODEL, Stack, code_of
from tests.support.waiting import wait_until

LAYERS, HEADS, HEAD_DIM = 3, 2, 16
ROPE = RopeParams(head_dim=HEAD_DIM, base=10000.0)


def _segment(rows: int, start: int, seed: int) -> tuple[SequenceKV, list[torch.Tensor]]:
    """K/V of ``rows`` tokens whose keys were roped at ``start``..; also the raw keys."""
    g = torch.Generator().manual_seed(seed)
    raw = [torch.randn(rows, HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(rows, HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    at = torch.arange(start, start + rows)
    return SequenceKV([apply_rope(k, at, ROPE) for k in raw], values), raw


def _store(stack: Stack, salt: str = "") -> SegmentStore:
    return SegmentStore(
        stack.client.target, MODEL, ROPE, num_layers=LAYERS, kv_heads=HEADS, cache_salt=salt
    )


@pytest.mark.transports
def test_a_segment_computed_anywhere_is_found_by_its_tokens_with_keys_at_zero(
    stack: Stack,
) -> None:
    tokens = list(range(1000, 1037))
    kv, raw = _segment(len(tokens), start=500, seed=1)
    with _store(stack) as store:
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
        assert stack.locked() == 0  # every read released its lock
    counters = stack.app.core.counters
    assert (counters.segment_stores, counters.segment_hits, counters.segment_misses) == (1, 1, 2)


def test_keys_name_the_model_and_tokens_only() -> None:
    assert segment_key("m", [1, 2, 3]) == segment_key("m", [1, 2, 3])
    assert segment_key("m", [1, 2, 3]) != segment_key("m", [1, 2, 4])
    assert segment_key("m", [1, 2, 3]) != segment_key("n", [1, 2, 3])
    assert len(segment_key("m", [])) == 32


def test_salts_keep_segments_apart(stack: Stack) -> None:
    tokens = [5] * 20
    kv, _ = _segment(20, start=0, seed=2)
    with _store(stack, salt="a") as a, _store(stack, salt="b") as b:
        a.put(tokens, kv, source_start=0)
        assert a.get(tokens) is not None
        assert b.get(tokens) is None


def test_a_gateway_that_forgot_the_context_gets_it_again(stack: Stack) -> None:
    kv, _ = _segment(8, start=0, seed=3)
    with _store(stack) as store:
        stack.client.unregister_engine_context(
            gateway_pb2.UnregisterEngineContextRequest(engine_id=store.engine_id)
        )
        assert store.put(list(range(8)), kv, source_start=0) is True
        assert store.get(list(range(8))) is not None


def _context(stack: Stack, engine_id: str, *, use_mla: bool = False, model: str = MODEL) -> None:
    stack.client.register_engine_context(
        gateway_pb2.RegisterEngineContextRequest(
            engine_id=engine_id, model_name=model, world_size=1, worker_id=0,
            layout=gateway_pb2.EngineContextLayout(
                num_layers=LAYERS, block_size=1, kv_heads=1 if use_mla else HEADS,
                head_dim=HEAD_DIM, dtype=common_pb2.DTYPE_FLOAT32, use_mla=use_mla,
            ),
        )
    )  # fmt: skip


def _refused(stack: Stack, **fields: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stack.client.prepare_segment_store(gateway_pb2.PrepareSegmentStoreRequest(**fields))  # type: ignore[arg-type]
    return info.value


def test_bad_segments_are_refused_by_name_and_a_full_node_says_so(
    make_stack: StackFactory,
) -> None:
    stack = make_stack(storage={"l1_size_bytes": 4 << 20, "l1_segment_bytes": 4 << 20})
    _context(stack, "ctx")
    # Another layout of one model would be refused (its chunks would share keys).
    _context(stack, "mla", use_mla=True, model=f"{MODEL}-mla")
    assert code_of(_refused(stack, engine_id="nobody", token_ids=[1])) == "FAILED_PRECONDITION"
    empty = _refused(stack, engine_id="ctx", token_ids=[])
    assert code_of(empty) == "INVALID_ARGUMENT"
    assert "at least one token" in empty.details()  # type: ignore[attr-defined]
    salted = _refused(stack, engine_id="ctx", cache_salt="x" * 10_000, token_ids=[1])
    assert code_of(salted) == "INVALID_ARGUMENT"
    mla = _refused(stack, engine_id="mla", token_ids=[1])
    assert code_of(mla) == "INVALID_ARGUMENT"
    assert "MLA" in mla.details()  # type: ignore[attr-defined]
    with _store(stack) as store:
        kv, _ = _segment(10, start=0, seed=3)
        with pytest.raises(ValueError, match="3 layers x 10 rows for 11 tokens"):
            store.put(list(range(11)), kv, source_start=0)
        big, _ = _segment(12_000, start=0, seed=4)  # 9 MiB: more than the node's whole L1
        with pytest.raises(grpc.RpcError) as info:
            store.put(list(range(12_000)), big, source_start=0)
        assert code_of(info.value) in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"), info.value
        assert store.get(list(range(12_000))) is None
        assert stack.locked() == 0


def _doc(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


@pytest.mark.transports
def test_stored_segments_are_found_inside_a_prompt_without_boundaries(stack: Stack) -> None:
    a, b, c, short = _doc(1000, 40), _doc(2000, 30), _doc(3000, 20), _doc(4000, 10)
    with _store(stack) as store:
        for doc, seed in ((a, 1), (b, 2), (c, 3), (short, 4)):
            kv, _ = _segment(len(doc), start=100, seed=seed)
            store.put(doc, kv, source_start=100)
        system, junk, question = _doc(7, 7), _doc(50, 5), _doc(60, 9)
        prompt = [*system, *b, *junk, *a, *c, *short, *question]
        # The short document (under 16 tokens) is not indexed: computed, not found.
        assert store.find(prompt) == [(7, 30), (42, 40), (82, 20)]
        segments = store.segments(prompt)
        assert [t for s in segments for t in s.tokens] == prompt
        assert [(len(s.tokens), s.kv is not None) for s in segments] == [
            (7, False), (30, True), (5, False), (40, True), (20, True), (19, False),
        ]  # fmt: skip
        assert stack.locked() == 0
        # Probing every 2nd position misses the document that starts at 7.
        assert store.find(prompt, stride=2) == [(42, 40), (82, 20)]
        assert store.find([*b[1:], *a]) == [(29, 40)]  # not at its start: not b
    with _store(stack, salt="other") as other:
        assert other.find(prompt) == []


def test_segments_gone_from_l1_are_not_found_and_leave_the_index(stack: Stack) -> None:
    doc = _doc(500, 32)
    with _store(stack) as store:
        kv, _ = _segment(len(doc), start=0, seed=5)
        store.put(doc, kv, source_start=0)
        assert store.find([1, 2, *doc]) == [(2, 32)]
        stack.client.clear(gateway_pb2.ClearRequest(force=True))
        assert store.find([1, 2, *doc]) == []
        assert store.segments([1, 2, *doc])[0].kv is None
    assert len(stack.node.app.node.segments.catalog) == 0  # the node forgot it


def test_segments_are_found_through_a_gateway_that_did_not_store_them(
    make_stack: StackFactory,
) -> None:
    # The fingerprint index lives in the storage node: a restarted gateway (here a
    # second one in front of the same node) finds what the first one stored.
    first = make_stack()
    doc = _doc(800, 48)
    with _store(first) as store:
        kv, _ = _segment(len(doc), start=30, seed=6)
        store.put(doc, kv, source_start=30)
    second = make_stack(node=first.node)
    with _store(second) as store:
        assert store.find([*_doc(9, 30), *doc, 5]) == [(30, 48)]
        assert store.segments([*_doc(9, 30), *doc])[1].kv is not None


def test_the_node_indexes_only_segments_whose_tokens_make_their_key(stack: Stack) -> None:
    # A PrepareStore naming tokens that are not the key's would plant a wrong hint.
    row = common_pb2.ChunkKeys(model_name=MODEL, chunk_hashes=[segment_key(MODEL, _doc(1, 20))])
    lying = storage_pb2.PrepareStoreRequest(
        keys=row, chunk_bytes=4096, segment_token_ids=_doc(2, 20)
    )
    error = stack.node.error("prepare_store", lying)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "segment_token_ids" in (error.details() or "")
    two = common_pb2.ChunkKeys(model_name=MODEL, chunk_hashes=[segment_key(MODEL, _doc(1, 20))] * 2)
    error = stack.node.error(
        "prepare_store",
        storage_pb2.PrepareStoreRequest(keys=two, chunk_bytes=4096, segment_token_ids=_doc(1, 20)),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(stack.node.app.node.segments.catalog) == 0


def test_a_lookup_of_a_bad_prompt_is_refused_by_name(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stack.client.lookup_segments(
            gateway_pb2.LookupSegmentsRequest(engine_id="nobody", token_ids=[1])
        )
    assert code_of(info.value) == "FAILED_PRECONDITION"
    _context(stack, "ctx")
    with pytest.raises(grpc.RpcError) as info:
        stack.client.lookup_segments(
            gateway_pb2.LookupSegmentsRequest(engine_id="ctx", cache_salt="x" * 10_000)
        )
    assert code_of(info.value) == "INVALID_ARGUMENT"
    empty = stack.client.lookup_segments(gateway_pb2.LookupSegmentsRequest(engine_id="ctx"))
    assert (list(empty.matches), empty.probed_positions) == ([], 0)


def test_a_segment_gone_from_l1_is_read_back_from_l2(make_stack: StackFactory) -> None:
    # An object loaded from L2 is temporary (freed with its last reader): the read must
    # hold it before the lookup that loaded it lets go.
    stack = make_stack(storage={"l2": ["disk"]})
    doc = _doc(600, 24)
    kv, raw = _segment(len(doc), start=3, seed=7)
    with _store(stack) as store:
        assert store.put(doc, kv, source_start=3)
        wait_until(lambda: len(stack.node.l2_hashes()) == 1)
        wait_until(lambda: stack.locked() == 0)  # the write-through read is over
        (chunk_hash,) = stack.l1()
        key = common_pb2.ObjectKey(chunk_hash=chunk_hash, model_name=MODEL,
                                   kv_rank=worker_kv_rank(1, 0))  # fmt: skip
        assert stack.delete([key]) == (1, 0)
        got = store.get(doc)
        assert got is not None
        zero = torch.arange(len(doc))
        torch.testing.assert_close(got.keys[0], apply_rope(raw[0], zero, ROPE))
        assert torch.equal(got.values[2], kv.values[2])
        assert stack.locked() == 0


def test_a_segment_read_slower_than_the_read_lock_ttl_is_not_used(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lock lapsed while the engine copied: eviction could have reused the slot, so
    # what it read cannot be trusted; the segment is computed instead.
    stack = make_stack(storage={"read_ttl_seconds": 0.5})
    tokens = list(range(4000, 4040))
    kv, _ = _segment(len(tokens), start=0, seed=11)
    real = segment_store._mapped

    @contextmanager
    def slow(region: Any, write: bool) -> Iterator[memoryview]:
        with real(region, write=write) as view:
            time.sleep(1.0)  # twice the read TTL
            yield view

    with _store(stack) as store:
        assert store.put(tokens, kv, source_start=0)
        monkeypatch.setattr(segment_store, "_mapped", slow)
        assert store.get(tokens) is None
        monkeypatch.setattr(segment_store, "_mapped", real)
        got = store.get(tokens)  # a read that ends in time is used
        assert got is not None
        assert torch.equal(got.values[0], kv.values[0])
    wait_until(lambda: stack.locked() == 0)
