"""CacheBlend segments across a fleet: a document computed on node A is found inside a
prompt on node B (the coordinator's blend index), fetched from A (P2P) and written into
B's engine at another position with its keys re-RoPEd.

Real processes: ``kvmesh coordinator --enable-blend-lookup`` and two ``kvmesh storage``
nodes; the oracle is RoPE applied directly to the raw keys at B's position
(tests.integration.storage.documents).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import directory_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import worker_kv_rank
from kvmesh.coordinator.client import DirectoryClient
from kvmesh.kernels.rope import RopeParams, apply_rope
from tests.integration.p2p.conftest import running_fleet
from tests.integration.storage.documents import ROPE, Document
from tests.integration.storage.support import HEAD_DIM, KV_HEADS, MODEL, NUM_LAYERS
from tests.support.waiting import wait_until

RANK = worker_kv_rank(1, 0)
DOCUMENT = list(range(5000, 5040))  # 40 tokens
TABLE_A, START_A = [3, 4, 5, 6], 13  # tokens 13..52 of a request on A
TABLE_B, START_B = [20, 21, 22, 23, 24], 29  # tokens 29..68 of a request on B
SEGMENT_BYTES = 2 * NUM_LAYERS * len(DOCUMENT) * KV_HEADS * HEAD_DIM * 2


def _key() -> common_pb2.ObjectKey:
    return common_pb2.ObjectKey(
        chunk_hash=segment_key(MODEL, DOCUMENT), model_name=MODEL, kv_rank=RANK
    )


def _placement(engine_id: str, table: list[int], start: int) -> storage_pb2.SegmentPlacement:
    return storage_pb2.SegmentPlacement(
        engine_id=engine_id, key=_key(), block_ids=table, start_token=start,
        num_tokens=len(DOCUMENT),
    )  # fmt: skip


def _find(node: Any, prompt: list[int]) -> list[tuple[int, int, bool]]:
    request = storage_pb2.FindSegmentsRequest(model_name=MODEL, kv_rank=RANK, token_ids=prompt)
    response = node.storage.FindSegments(request, timeout=10)
    return [(m.start_token, m.num_tokens, m.on_this_node) for m in response.matches]


def test_a_document_computed_on_one_node_is_served_on_another(
    tmp_path: Path, shm_root: Path
) -> None:
    with running_fleet(tmp_path, shm_root, coordinator_extra=["--enable-blend-lookup"]) as fleet:
        a, b = fleet.a, fleet.b
        for node in (a, b):  # register again, with the model's RoPE parameters
            node.storage.UnregisterEngineMemory(
                storage_pb2.UnregisterEngineMemoryRequest(engine_id=node.engine.engine_id),
                timeout=10,
            )
            node.storage.RegisterEngineMemory(
                node.engine.register_request(layout=node.engine.layout(rope=ROPE)), timeout=30
            )
        document = Document(len(DOCUMENT), seed=4)
        document.write(a.engine, TABLE_A, START_A)
        placement = _placement(a.engine.engine_id, TABLE_A, START_A)
        placement.token_ids.extend(DOCUMENT)
        stored = a.storage.StoreSegment(storage_pb2.StoreSegmentRequest(segment=placement))
        assert stored.outcome == storage_pb2.STORE_OUTCOME_STORED

        # The coordinator learns it from A's STORE event and finds it inside a prompt.
        prompt = [*range(1, 1 + START_B), *DOCUMENT, 9, 9, 9]
        query = directory_pb2.BlendLookupRequest(
            tokens=directory_pb2.TokenQuery(model_name=MODEL, token_ids=prompt)
        )
        with DirectoryClient(fleet.coordinator.target) as directory:
            wait_until(
                lambda: len(directory.blend_lookup(query).matches) == 1,
                timeout=20,
                message="the coordinator never indexed A's segment",
            )
            match = directory.blend_lookup(query).matches[0]
        assert (match.start_token, match.num_tokens) == (START_B, len(DOCUMENT))
        assert [p.instance_id for p in match.ranks[0].placements] == [a.status().instance_id]

        # B finds it through the coordinator, fetches it from A, and serves it at START_B.
        assert _find(b, prompt) == [(START_B, len(DOCUMENT), False)]
        lookup = b.storage.LookupAndLock(
            storage_pb2.LookupAndLockRequest(
                keys=common_pb2.KeyGrid(
                    model_name=MODEL, kv_ranks=[RANK], chunk_hashes=[_key().chunk_hash]
                ),
                wait_timeout_ms=20_000,
                chunk_bytes=SEGMENT_BYTES,
            ),
            timeout=30,
        )
        assert lookup.result.hit_chunks == 1
        b.storage.ReleaseLease(
            storage_pb2.ReleaseLeaseRequest(lease_id=lookup.prefetch_id, end=True), timeout=5
        )
        assert _find(b, prompt) == [(START_B, len(DOCUMENT), True)]
        b.engine.fill(TABLE_B, 7.0)
        served = b.storage.RetrieveSegment(
            storage_pb2.RetrieveSegmentRequest(
                segment=_placement(b.engine.engine_id, TABLE_B, START_B)
            ),
            timeout=30,
        )
        assert served.found
        document.assert_at(b.engine, TABLE_B, START_B)
        assert b.read_locked() == 0


def test_an_engine_on_another_node_finds_and_reads_the_document_through_its_gateway(
    tmp_path: Path, shm_root: Path
) -> None:
    # What kvmesh's blending engine does (engine.segment_store.SegmentStore), each
    # engine behind its own node's gateway: B's gateway finds A's document in an
    # unsegmented prompt and its PrepareSegmentRetrieve fetches it from A (P2P).
    from kvmesh.engine.llama import SequenceKV
    from kvmesh.engine.segment_store import SegmentStore
    from tests.integration.coordinator.support import CliProcess
    from tests.support.ports import free_port

    layers, heads, dim = 2, 2, 16
    rope = RopeParams(head_dim=dim, base=10000.0)
    g = torch.Generator().manual_seed(8)
    raw = [torch.randn(len(DOCUMENT), heads, dim, generator=g) for _ in range(layers)]
    kv = SequenceKV(
        [apply_rope(k, torch.arange(7, 7 + len(DOCUMENT)), rope) for k in raw],
        [torch.randn(len(DOCUMENT), heads, dim, generator=g) for _ in range(layers)],
    )
    with running_fleet(tmp_path, shm_root, coordinator_extra=["--enable-blend-lookup"]) as fleet:
        gateways = [
            CliProcess("gateway", free_port(), ["--storage-target", node.target])
            for node in (fleet.a, fleet.b)
        ]
        try:
            for gateway in gateways:
                gateway.start()
            stores = [
                SegmentStore(gw.target, MODEL, rope, num_layers=layers, kv_heads=heads)
                for gw in gateways
            ]
            on_a, on_b = stores
            assert on_a.put(DOCUMENT, kv, source_start=7)
            prompt = [*range(1, 12), *DOCUMENT, 4, 4]
            wait_until(
                lambda: on_b.find(prompt) == [(11, len(DOCUMENT))],
                timeout=20,
                message="B's gateway never found A's document",
            )
            got = on_b.get(DOCUMENT)
            assert got is not None
            zero = torch.arange(len(DOCUMENT))
            for layer in range(layers):
                torch.testing.assert_close(got.keys[layer], apply_rope(raw[layer], zero, rope))
                assert torch.equal(got.values[layer], kv.values[layer])
            assert fleet.b.read_locked() == 0
            for store in stores:
                store.close()
        finally:
            for gateway in gateways:
                gateway.kill()
