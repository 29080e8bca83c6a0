"""StoreSegment / RetrieveSegment over a real socket: a document's K/V moved between
positions of two requests, keys re-RoPEd with the parameters registered with the layout.

The oracle is RoPE applied directly to the raw keys at each position
(tests.integration.storage.documents): what a full prefill would have written there.
"""

from __future__ import annotations

import os
from typing import Any

import grpc
import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common.hashing import segment_key
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.documents import ROPE, Document
from tests.integration.storage.support import (
    ALREADY,
    BLOCK_SIZE,
    HEAD_DIM,
    MODEL,
    STORED,
    Engine,
    Node,
)

TABLE_A = [5, 9, 2, 40]  # request A: tokens 0..63
TABLE_B = [11, 3, 60, 7, 30, 31]  # request B: tokens 0..95
START_A, START_B, COUNT = 21, 50, 37


def _register(node: Node, engine: Engine, rope: common_pb2.RopeParameters | None = ROPE) -> None:
    layout = engine.layout(rope=rope) if rope is not None else engine.layout()
    node.call("register_engine_memory", engine.register_request(layout=layout))


def _placement(engine: Engine, key: bytes, table: list[int], start: int,
               count: int = COUNT) -> storage_pb2.SegmentPlacement:  # fmt: skip
    return storage_pb2.SegmentPlacement(
        engine_id=engine.engine_id,
        key=common_pb2.ObjectKey(chunk_hash=key, model_name=MODEL),
        block_ids=table, start_token=start, num_tokens=count,
    )  # fmt: skip


def _store(node: Node, placement: storage_pb2.SegmentPlacement) -> int:
    request = storage_pb2.StoreSegmentRequest(segment=placement)
    return int(node.call("store_segment", request).outcome)


def _retrieve(node: Node, placement: storage_pb2.SegmentPlacement) -> bool:
    request = storage_pb2.RetrieveSegmentRequest(segment=placement)
    return bool(node.call("retrieve_segment", request).found)


def test_a_document_stored_at_one_position_is_served_at_another(
    make_node: NodeFactory, engine: Engine
) -> None:
    node = make_node()
    _register(node, engine)
    document = Document(COUNT)
    document.write(engine, TABLE_A, START_A)
    key = os.urandom(32)
    assert _store(node, _placement(engine, key, TABLE_A, START_A)) == STORED
    assert _store(node, _placement(engine, key, TABLE_A, START_A)) == ALREADY

    engine.fill(TABLE_B, 7.0)  # request B's blocks hold something else
    assert _retrieve(node, _placement(engine, key, TABLE_B, START_B))

    document.assert_at(engine, TABLE_B, START_B)
    # B's other tokens (before 50 and after 86, in the same blocks) are untouched.
    others = [t for t in range(len(TABLE_B) * BLOCK_SIZE) if not START_B <= t < START_B + COUNT]
    rest = np.stack([engine.kv[:, :, TABLE_B[t // BLOCK_SIZE], t % BLOCK_SIZE] for t in others])
    assert (rest == 7.0).all()


def test_a_segment_not_in_l1_writes_nothing(node: Node, engine: Engine) -> None:
    node.call("unregister_engine_memory",
              storage_pb2.UnregisterEngineMemoryRequest(engine_id=engine.engine_id))  # fmt: skip
    _register(node, engine)
    before = engine.snapshot()
    assert not _retrieve(node, _placement(engine, os.urandom(32), TABLE_B, START_B))
    assert np.array_equal(engine.snapshot(), before)


def _code(node: Node, method: str, request: Any) -> tuple[grpc.StatusCode, str]:
    error = node.error(method, request)
    return error.code(), error.details() or ""


@pytest.mark.parametrize("method", ["store_segment", "retrieve_segment"])
def test_an_engine_registered_without_rope_is_refused(
    node: Node, engine: Engine, method: str
) -> None:
    placement = _placement(engine, os.urandom(32), TABLE_A, START_A)
    request: Any = (storage_pb2.StoreSegmentRequest if method == "store_segment"
                    else storage_pb2.RetrieveSegmentRequest)(segment=placement)  # fmt: skip
    code, details = _code(node, method, request)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "RoPE" in details


@pytest.mark.parametrize(
    ("change", "code", "words"),
    [
        ({"block_ids": TABLE_A[:2]}, grpc.StatusCode.INVALID_ARGUMENT, "need 4 block ids"),
        ({"block_ids": [5, 9, 2, 64]}, grpc.StatusCode.INVALID_ARGUMENT, "outside"),
        ({"num_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "num_tokens"),
        ({"key": None}, grpc.StatusCode.INVALID_ARGUMENT, "segment.key"),
        ({"engine_id": "nobody"}, grpc.StatusCode.FAILED_PRECONDITION, "not registered"),
    ],
)
def test_bad_placements_are_refused_and_change_nothing(
    make_node: NodeFactory, engine: Engine, change: dict[str, Any], code: grpc.StatusCode,
    words: str,
) -> None:  # fmt: skip
    node = make_node()
    _register(node, engine)
    key = os.urandom(32)
    assert _store(node, _placement(engine, key, TABLE_A, START_A)) == STORED
    placement = _placement(engine, key, TABLE_A, START_A)
    for name, value in change.items():
        if value is None:
            placement.ClearField(name)
        elif name == "block_ids":
            del placement.block_ids[:]
            placement.block_ids.extend(value)
        else:
            setattr(placement, name, value)
    before = engine.snapshot()
    for method, message in (("store_segment", storage_pb2.StoreSegmentRequest),
                            ("retrieve_segment", storage_pb2.RetrieveSegmentRequest)):  # fmt: skip
        got, details = _code(node, method, message(segment=placement))
        assert got == code, details
        assert words in details
    assert np.array_equal(engine.snapshot(), before)


def test_a_block_listed_twice_is_refused_before_any_write(
    make_node: NodeFactory, engine: Engine
) -> None:
    node = make_node()
    _register(node, engine)
    key = os.urandom(32)
    assert _store(node, _placement(engine, key, TABLE_A, START_A)) == STORED
    before = engine.snapshot()
    twice = _placement(engine, key, [11, 3, 60, 7, 30, 7], START_B)  # 7 among the written
    request = storage_pb2.RetrieveSegmentRequest(segment=twice)
    code, details = _code(node, "retrieve_segment", request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "twice" in details
    assert np.array_equal(engine.snapshot(), before)


@pytest.mark.parametrize(
    ("rope", "words"),
    [
        (common_pb2.RopeParameters(base=0.0), "base must be positive"),
        (common_pb2.RopeParameters(base=1e4, rotary_dim=3), "rotary_dim"),
        (common_pb2.RopeParameters(base=1e4, rotary_dim=HEAD_DIM + 2), "rotary_dim"),
        (common_pb2.RopeParameters(base=1e4, style=9), "style"),  # type: ignore[arg-type]
    ],
)
def test_bad_rope_parameters_are_refused_at_registration(
    make_node: NodeFactory, engine: Engine, rope: common_pb2.RopeParameters, words: str
) -> None:
    node = make_node()
    request = engine.register_request(layout=engine.layout(rope=rope))
    code, details = _code(node, "register_engine_memory", request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in details


def test_registering_again_with_other_rope_parameters_is_refused(
    make_node: NodeFactory, engine: Engine
) -> None:
    node = make_node()
    _register(node, engine)
    _register(node, engine)  # the same parameters: idempotent
    other = engine.register_request(layout=engine.layout(rope=common_pb2.RopeParameters(base=5e5)))
    code, _ = _code(node, "register_engine_memory", other)
    assert code == grpc.StatusCode.ALREADY_EXISTS


def _tokens(first: int, n: int = COUNT) -> list[int]:
    return list(range(first, first + n))


def _find(node: Node, prompt: list[int], stride: int = 1) -> list[tuple[int, int]]:
    request = storage_pb2.FindSegmentsRequest(model_name=MODEL, token_ids=prompt, stride=stride)
    return [(m.start_token, m.num_tokens) for m in node.call("find_segments", request).matches]


def test_a_segment_stored_with_its_tokens_is_found_inside_another_prompt(
    make_node: NodeFactory, engine: Engine
) -> None:
    node = make_node()
    _register(node, engine)
    document = _tokens(900)
    placement = _placement(engine, segment_key(MODEL, document), TABLE_A, START_A)
    placement.token_ids.extend(document)
    assert _store(node, placement) == STORED
    prompt = [*_tokens(1, START_B), *document, 7, 7]
    assert _find(node, prompt) == [(START_B, COUNT)]
    # Found where it sits: served there, keys moved to START_B.
    assert _retrieve(node, _placement(engine, segment_key(MODEL, document), TABLE_B, START_B))
    assert _find(node, [*document[1:], 5]) == []  # not at its start
    # Gone from L1: not found, and the hint is dropped.
    node.call("clear", storage_pb2.ClearRequest(force=True))
    assert _find(node, prompt) == []
    assert len(node.app.node.segments.catalog) == 0


@pytest.mark.parametrize(
    ("tokens", "words"),
    [(_tokens(5), "not the tokens"), (_tokens(900, COUNT - 1), "num_tokens is 37")],
)
def test_segment_tokens_that_do_not_make_the_key_are_refused(
    make_node: NodeFactory, engine: Engine, tokens: list[int], words: str
) -> None:
    node = make_node()
    _register(node, engine)
    placement = _placement(engine, segment_key(MODEL, _tokens(900)), TABLE_A, START_A)
    placement.token_ids.extend(tokens)
    code, details = _code(node, "store_segment", storage_pb2.StoreSegmentRequest(segment=placement))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in details
    assert len(node.app.node.segments.catalog) == 0


def test_a_find_without_a_model_is_refused(node: Node) -> None:
    code, details = _code(node, "find_segments", storage_pb2.FindSegmentsRequest(token_ids=[1]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "model_name" in details
