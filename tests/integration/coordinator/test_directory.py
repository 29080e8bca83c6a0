"""DirectoryService over a real socket: Lookup (keys, tokens), ListKeys, GetStats, cursors.

LMCache behaviours that do not apply: blend matching (kvmesh keeps no blend
index) and the prefetch proxy (the coordinator never dials a node).
"""

from __future__ import annotations

import grpc
import pytest

from kvmesh.api.coordinator.v1 import directory_pb2
from kvmesh.common.keys import worker_kv_rank
from tests.integration.coordinator.conftest import CHUNK
from tests.integration.coordinator.support import (
    ACCESS,
    ADMITTED,
    DELETE,
    DUPLICATE,
    L1,
    L2,
    MODEL,
    Coord,
    batch,
    code_of,
    entry,
    field_of,
    hkey,
    pkey,
    stores,
    token_hashes,
)


def _tokens(query: directory_pb2.TokenQuery, include: bool = False) -> directory_pb2.LookupRequest:
    return directory_pb2.LookupRequest(tokens=query, include_token_ids=include)


def test_lookup_by_keys_answers_in_request_order(coord: Coord) -> None:
    """Placement fields; an unknown key has no placements (chunks = keys)."""
    c = coord.clients
    c.ingest_batches(
        batch("node-b", 1, tier=L1, entries=stores([1], size=10)),
        batch("node-a", 1, tier=L2, entries=stores([1], size=20)),
        batch("node-a", 2, tier=L1, entries=stores([1, 2], size=30)),
        batch("node-a", 3, event_type=ACCESS, backend="", entries=stores([1, 1, 3]), ts=1.7e9),
    )
    response = c.lookup(pkey(3), pkey(1), pkey(2))
    assert response.chunks == 3
    assert [r.key for r in response.results] == [pkey(3), pkey(1), pkey(2)]
    unknown, k1, k2 = response.results
    assert (list(unknown.placements), unknown.access_count) == ([], 0)  # ACCESS creates nothing
    # Sorted by (instance, tier, backend); access counted per entry.
    assert [(p.instance_id, p.tier, p.backend, p.size_bytes) for p in k1.placements] == [
        ("node-a", L1, "dram", 30),
        ("node-a", L2, "disk", 20),
        ("node-b", L1, "dram", 10),
    ]
    assert k1.access_count == 2
    assert k1.last_access.seconds == 1_700_000_000
    assert [p.incarnation for p in k2.placements] == [1]


def test_lookup_returns_tokens_only_when_asked(coord: Coord) -> None:
    """Stored tokens come back, never an offset; an unknown chunk has none."""
    c = coord.clients
    c.ingest_batches(
        batch(
            "node-a",
            1,
            entries=[entry(pkey(1), tokens=[5, 6, 7, 8], offset=0), entry(pkey(2))],
        )
    )
    plain = c.lookup(pkey(1), pkey(2)).results
    assert [list(r.token_ids) for r in plain] == [[], []]
    assert [r.num_tokens for r in plain] == [4, 0]
    with_tokens = c.lookup(pkey(1), pkey(2), include_token_ids=True).results
    assert [list(r.token_ids) for r in with_tokens] == [[5, 6, 7, 8], []]


def test_lookup_by_tokens_counts_the_cached_prefix(coord: Coord) -> None:
    c = coord.clients
    tokens = list(range(100, 111))  # 2 complete chunks of 4, a partial one ignored
    h0, h1 = token_hashes(tokens, CHUNK)
    query = directory_pb2.TokenQuery(model_name=MODEL, token_ids=tokens)
    empty = c.directory.lookup(_tokens(query))
    assert (empty.chunks, empty.cached_prefix_chunks, len(empty.results)) == (2, 0, 2)
    # Only the second chunk: no prefix.
    c.ingest_batches(batch("node-a", 1, entries=[entry(hkey(h1), tokens=tokens[4:8], offset=4)]))
    assert c.directory.lookup(_tokens(query)).cached_prefix_chunks == 0
    c.ingest_batches(batch("node-a", 2, entries=[entry(hkey(h0), tokens=tokens[:4], offset=0)]))
    full = c.directory.lookup(_tokens(query, include=True))
    assert (full.chunks, full.cached_prefix_chunks) == (2, 2)
    assert [r.key.chunk_hash for r in full.results] == [h0, h1]
    assert [list(r.token_ids) for r in full.results] == [tokens[:4], tokens[4:8]]
    assert all(r.placements for r in full.results)
    # Shorter than one chunk: nothing to look up.
    short = c.directory.lookup(
        _tokens(directory_pb2.TokenQuery(model_name=MODEL, token_ids=[1, 2, 3]))
    )
    assert (short.chunks, list(short.results)) == (0, [])
    # The salt is part of the key: another tenant sees nothing.
    other = directory_pb2.TokenQuery(model_name=MODEL, token_ids=tokens, cache_salt="t2")
    assert c.directory.lookup(_tokens(other)).cached_prefix_chunks == 0


def test_lookup_by_tokens_needs_every_rank(coord: Coord) -> None:
    c = coord.clients
    tokens = list(range(8))
    h0, h1 = token_hashes(tokens, CHUNK)
    r0, r1 = worker_kv_rank(2, 0), worker_kv_rank(2, 1)
    c.ingest_batches(
        batch(
            "node-a",
            1,
            entries=[entry(hkey(h0, rank=r0)), entry(hkey(h0, rank=r1)), entry(hkey(h1, rank=r0))],
        )
    )
    query = directory_pb2.TokenQuery(model_name=MODEL, world_size=2, token_ids=tokens)
    response = c.directory.lookup(_tokens(query))
    assert (response.chunks, len(response.results), response.cached_prefix_chunks) == (2, 4, 1)
    # Chunk-major, then rank.
    assert [(r.key.chunk_hash, r.key.kv_rank) for r in response.results] == [
        (h0, r0),
        (h0, r1),
        (h1, r0),
        (h1, r1),
    ]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (directory_pb2.LookupRequest(), "query"),
        (
            directory_pb2.LookupRequest(
                keys=directory_pb2.KeyList(keys=[pkey(1), hkey(b"\x00" * 16)])
            ),
            "keys.keys[1].chunk_hash",
        ),
        (
            directory_pb2.LookupRequest(tokens=directory_pb2.TokenQuery(token_ids=[1, 2, 3, 4])),
            "tokens.model_name",
        ),
        (
            directory_pb2.LookupRequest(
                tokens=directory_pb2.TokenQuery(model_name="a@b", token_ids=[1, 2, 3, 4])
            ),
            "tokens.model_name",
        ),
        (
            directory_pb2.LookupRequest(
                tokens=directory_pb2.TokenQuery(
                    model_name=MODEL, cache_salt="a/b", token_ids=[1, 2, 3, 4]
                )
            ),
            "tokens.cache_salt",
        ),
        (
            directory_pb2.LookupRequest(
                tokens=directory_pb2.TokenQuery(model_name=MODEL, token_ids=[0] * 1_000_001)
            ),
            "tokens.token_ids",
        ),
    ],
    ids=[
        "neither-form",
        "bad-key",
        "tokens-without-model",
        "bad-model",
        "bad-salt",
        "too-many-tokens",
    ],
)
def test_bad_lookups_are_invalid_argument(
    coord: Coord, request_: directory_pb2.LookupRequest, field: str
) -> None:
    """A bad key, neither form, or tokens without a model are rejected."""
    with pytest.raises(grpc.RpcError) as info:
        coord.clients.directory.lookup(request_)
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == field


def test_list_keys_pages_until_the_token_is_empty(coord: Coord) -> None:
    """The listing paginates (page tokens for offsets) with a stable total."""
    c = coord.clients
    ids = range(2500)
    c.ingest_batches(
        *(
            batch("node-a", seq + 1, tier=L2, entries=stores(ids[i : i + 500]))
            for seq, i in enumerate(range(0, 2500, 500))
        ),
        batch("node-b", 1, tier=L1, entries=stores(range(2400, 2600), size=7)),
    )
    seen: list[bytes] = []
    token = ""
    pages = 0
    while True:
        page = c.directory.list_keys(directory_pb2.ListKeysRequest(page_size=700, page_token=token))
        pages += 1
        assert len(page.keys) <= 700
        assert page.HasField("total")
        assert page.total == 2600
        seen.extend(k.key.chunk_hash for k in page.keys)
        token = page.next_page_token
        if not token:
            break
    assert pages >= 4
    assert sorted(seen) == sorted(i.to_bytes(32, "big") for i in range(2600))
    assert len(seen) == len(set(seen))


def test_list_keys_filters_keys_and_their_placements(coord: Coord) -> None:
    """Tier, instance and backend filters; placements are filtered too."""
    c = coord.clients
    c.ingest_batches(
        batch("node-a", 1, tier=L1, entries=stores([1, 2])),
        batch("node-a", 2, tier=L2, entries=stores([2, 3])),
        batch("node-b", 1, tier=L2, backend="redis", entries=stores([3, 4])),
    )

    def listed(**filters: object) -> dict[int, list[tuple[str, int, str]]]:
        out: dict[int, list[tuple[str, int, str]]] = {}
        for k in c.list_all(**filters):
            out[int.from_bytes(k.key.chunk_hash, "big")] = [
                (p.instance_id, int(p.tier), p.backend) for p in k.placements
            ]
        return out

    assert listed(tier=L1) == {1: [("node-a", L1, "dram")], 2: [("node-a", L1, "dram")]}
    assert listed(tier=L2, instance_id="node-a") == {
        2: [("node-a", L2, "disk")],
        3: [("node-a", L2, "disk")],
    }
    assert listed(backend="redis") == {3: [("node-b", L2, "redis")], 4: [("node-b", L2, "redis")]}
    assert listed(instance_id="nobody") == {}
    assert set(listed()) == {1, 2, 3, 4}
    filtered = c.directory.list_keys(directory_pb2.ListKeysRequest(tier=L1))
    assert not filtered.HasField("total")  # an exact filtered count would need a full scan
    # Listings carry num_tokens but never the tokens themselves.
    assert all(list(k.token_ids) == [] for k in c.list_all())


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (directory_pb2.ListKeysRequest(page_size=10_001), "page_size"),
        (directory_pb2.ListKeysRequest(page_token="not-a-token"), "page_token"),
    ],
    ids=["page-too-big", "bad-token"],
)
def test_bad_listings_are_invalid_argument(
    coord: Coord, request_: directory_pb2.ListKeysRequest, field: str
) -> None:
    """A bad page size or page token (LMCache: offset=-1) is rejected."""
    with pytest.raises(grpc.RpcError) as info:
        coord.clients.directory.list_keys(request_)
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == field


def test_get_stats_totals(coord: Coord) -> None:
    """Keys, placements, L1 keys per instance, no instance list; token bindings."""
    c = coord.clients
    assert c.stats() == directory_pb2.GetStatsResponse()
    c.ingest_batches(
        batch("node-a", 1, tier=L1, entries=[entry(pkey(1), 10, tokens=[1, 2, 3, 4], offset=0)]),
        batch("node-a", 2, tier=L1, entries=stores([2], size=20)),
        batch("node-a", 3, tier=L2, entries=stores([1], size=40)),
        batch("node-b", 1, tier=L2, entries=stores([3], size=80)),
    )
    stats = c.stats()
    assert (stats.num_keys, stats.num_placements) == (3, 4)
    assert (stats.l1_placements, stats.l1_size_bytes) == (2, 30)
    assert (stats.l2_placements, stats.l2_size_bytes) == (2, 120)
    assert dict(stats.l1_keys_by_instance) == {"node-a": 2, "node-b": 0}
    assert stats.token_bindings == 1
    c.ingest_batches(batch("node-a", 4, tier=L1, event_type=DELETE, entries=stores([1, 2])))
    stats = c.stats()
    assert (stats.num_keys, stats.l1_placements, stats.l1_size_bytes) == (2, 0, 0)
    assert dict(stats.l1_keys_by_instance) == {"node-a": 0, "node-b": 0}


def test_ingest_cursors_show_incarnation_seq_gap_and_counters(coord: Coord) -> None:
    """A skipped seq is admitted and sets the sticky gap flag."""
    c = coord.clients
    assert c.cursors() == {}
    node = coord.node("node-a", incarnation=3)
    node.batch(1, entries=stores([1]))
    node.batch(2, entries=stores([2]))
    node.wait_acks(2)
    cursor = c.cursors()["node-a"]
    assert (cursor.incarnation, cursor.last_seq, cursor.gap_detected) == (3, 2, False)
    assert (cursor.batches_admitted, cursor.batches_duplicate, cursor.batches_stale) == (2, 0, 0)
    assert cursor.last_admitted.seconds > 0
    node.batch(2, entries=stores([2]))  # duplicate
    node.batch(5, entries=stores([5]))  # 3 and 4 never arrived
    node.batch(6, entries=stores([6]))
    assert [a.result for a in node.wait_acks(5)][2:] == [DUPLICATE, ADMITTED, ADMITTED]
    cursor = c.cursors()["node-a"]
    assert (cursor.last_seq, cursor.gap_detected) == (6, True)  # sticky
    assert (cursor.batches_admitted, cursor.batches_duplicate) == (4, 1)
    # A new incarnation starts a fresh cursor (the gap flag clears); counters carry on.
    node.close()
    restarted = coord.node("node-a", incarnation=4)
    restarted.batch(1, entries=stores([7]))
    restarted.wait_acks(1)
    cursor = c.cursors()["node-a"]
    assert (cursor.incarnation, cursor.last_seq, cursor.gap_detected) == (4, 1, False)
    assert cursor.batches_admitted == 5
    # The first batch of a never-seen emitter with seq > 1 is a gap too.
    c.ingest_batches(batch("node-b", 3, entries=stores([8])))
    assert c.cursors()["node-b"].gap_detected
    restarted.close()
