"""CacheBlend for an engine that registered its KV cache (as vLLM's connector does):
StoreSegment, LookupSegments and RetrieveSegment through a real gateway and node.

The node copies between the engine's paged blocks and the segment object itself,
rotating the keys; the oracle is RoPE applied directly to the raw keys where the
document sits (tests.integration.storage.documents). Marked ``transports``: every
gateway/storage arrangement, so both storage links carry the calls.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import worker_kv_rank
from tests.integration.gateway.conftest import StackFactory
from tests.integration.gateway.support import MODEL, Stack, code_of
from tests.integration.storage.documents import ROPE, Document
from tests.integration.storage.support import Engine
from tests.support.waiting import wait_until

DOCUMENT = list(range(3000, 3045))  # 45 tokens
TABLE_A, START_A = [5, 9, 2, 40], 7  # tokens 7..51 of request A
TABLE_B, START_B = [11, 3, 60, 7, 30, 31], 40  # tokens 40..84 of request B


def _placement(engine: Engine, table: list[int], start: int, **change: Any) -> Any:
    fields: dict[str, Any] = {
        "engine_id": engine.engine_id,
        "token_ids": DOCUMENT,
        "block_ids": table,
        "start_token": start,
    }
    fields.update(change)
    return gateway_pb2.SegmentPlacement(**fields)


def _store(stack: Stack, placement: Any) -> gateway_pb2.StoreSegmentResponse:
    return stack.client.store_segment(gateway_pb2.StoreSegmentRequest(segment=placement))


def _retrieve(stack: Stack, placement: Any) -> bool:
    request = gateway_pb2.RetrieveSegmentRequest(segment=placement)
    return stack.client.retrieve_segment(request).found


def _lookup(stack: Stack, engine: Engine, prompt: list[int]) -> gateway_pb2.LookupSegmentsResponse:
    return stack.client.lookup_segments(
        gateway_pb2.LookupSegmentsRequest(engine_id=engine.engine_id, token_ids=prompt)
    )


@pytest.mark.transports
def test_a_document_of_one_request_is_found_and_written_into_another(
    stack: Stack, engine: Engine
) -> None:
    stack.register(engine, rope=ROPE)
    document = Document(len(DOCUMENT))
    document.write(engine, TABLE_A, START_A)
    stored = _store(stack, _placement(engine, TABLE_A, START_A))
    assert (stored.stored, stored.already_cached) == (True, False)
    again = _store(stack, _placement(engine, TABLE_A, START_A))
    assert (again.stored, again.already_cached) == (False, True)

    prompt = [*range(1, 1 + START_B), *DOCUMENT, 8, 8]
    found = _lookup(stack, engine, prompt)
    assert [(m.start_token, m.num_tokens) for m in found.matches] == [(START_B, len(DOCUMENT))]
    assert found.prefix_tokens == 0
    at_start = _lookup(stack, engine, [*DOCUMENT, 8])
    assert at_start.prefix_tokens == len(DOCUMENT)  # a document at 0 is a prefix hit

    engine.fill(TABLE_B, 7.0)
    assert _retrieve(stack, _placement(engine, TABLE_B, START_B))
    document.assert_at(engine, TABLE_B, START_B)
    assert stack.locked() == 0
    counters = stack.app.core.counters
    assert (counters.segment_stores, counters.segment_hits) == (1, 3)  # 2 found, 1 served


def test_a_document_stored_nowhere_is_not_found_and_nothing_is_written(
    ready: Stack, engine: Engine
) -> None:
    ready.client.unregister_kv_cache(
        gateway_pb2.UnregisterKVCacheRequest(engine_id=engine.engine_id)
    )
    ready.register(engine, rope=ROPE)
    before = engine.snapshot()
    assert not _retrieve(ready, _placement(engine, TABLE_B, START_B))
    assert np.array_equal(engine.snapshot(), before)
    assert ready.app.core.counters.segment_misses == 1


def _refusal(stack: Stack, placement: Any, method: str = "store_segment") -> tuple[str, str]:
    message = (gateway_pb2.StoreSegmentRequest if method == "store_segment"
               else gateway_pb2.RetrieveSegmentRequest)  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        getattr(stack.client, method)(message(segment=placement))
    return code_of(info.value), info.value.details() or ""


@pytest.mark.parametrize("method", ["store_segment", "retrieve_segment"])
@pytest.mark.parametrize(
    ("change", "code", "words"),
    [
        ({"engine_id": "nobody"}, "FAILED_PRECONDITION", "has not registered its KV cache"),
        ({"token_ids": []}, "INVALID_ARGUMENT", "at least one token"),
        ({"cache_salt": "x" * 10_000}, "INVALID_ARGUMENT", "cache_salt"),
        ({"block_ids": [5, 9]}, "INVALID_ARGUMENT", "block ids"),
        ({"block_ids": [5, 9, 2, 64]}, "INVALID_ARGUMENT", "outside"),
    ],
)
def test_bad_placements_are_refused_by_name_and_change_nothing(
    stack: Stack, engine: Engine, method: str, change: dict[str, Any], code: str, words: str
) -> None:
    stack.register(engine, rope=ROPE)
    before = engine.snapshot()
    got, details = _refusal(stack, _placement(engine, TABLE_A, START_A, **change), method)
    assert (got, words in details) == (code, True), details
    assert np.array_equal(engine.snapshot(), before)
    assert stack.l1() == set()


def test_an_engine_without_rope_parameters_or_an_engine_driven_context_is_refused(
    ready: Stack, engine: Engine
) -> None:
    code, details = _refusal(ready, _placement(engine, TABLE_A, START_A))
    assert (code, "RoPE" in details) == ("FAILED_PRECONDITION", True)
    ready.client.register_engine_context(
        gateway_pb2.RegisterEngineContextRequest(
            engine_id="ctx", model_name=MODEL, world_size=1, worker_id=0,
            layout=gateway_pb2.EngineContextLayout(
                num_layers=2, block_size=1, kv_heads=2, head_dim=8,
                dtype=common_pb2.DTYPE_FLOAT16,
            ),
        )
    )  # fmt: skip
    code, _ = _refusal(ready, _placement(engine, TABLE_A, START_A, engine_id="ctx"))
    assert code == "FAILED_PRECONDITION"


def test_a_document_gone_from_l1_is_loaded_back_from_l2_for_the_retrieve(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack(storage={"l2": ["disk"]})
    stack.register(engine, rope=ROPE)
    document = Document(len(DOCUMENT), seed=9)
    document.write(engine, TABLE_A, START_A)
    assert _store(stack, _placement(engine, TABLE_A, START_A)).stored
    key = common_pb2.ObjectKey(
        chunk_hash=segment_key(MODEL, DOCUMENT), model_name=MODEL, kv_rank=worker_kv_rank(1, 0)
    )
    wait_until(lambda: stack.node.l2_hashes() == {key.chunk_hash})
    wait_until(lambda: stack.locked() == 0)  # the write-through read is over
    assert stack.delete([key]) == (1, 0)
    assert stack.l1() == set()

    engine.fill(TABLE_B, 7.0)
    assert _retrieve(stack, _placement(engine, TABLE_B, START_B))
    document.assert_at(engine, TABLE_B, START_B)
    assert stack.locked() == 0
