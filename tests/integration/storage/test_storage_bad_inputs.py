"""Every bad input gets its status code, and nothing is lost or corrupted.

Each test starts from a node holding two stored chunks of a registered
engine, sends one bad request, checks the status code, and then checks that
the engine's memory is byte-for-byte unchanged, that L1 holds the same keys
with the same bytes, and that no lock was left behind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from tests.integration.storage.conftest import NodeFactory, ShmDirs
from tests.integration.storage.support import (
    BLOCKS_PER_CHUNK,
    CHUNK_BYTES,
    CHUNK_TOKENS,
    LAYER_BYTES,
    NUM_BLOCKS,
    NUM_LAYERS,
    Engine,
    Node,
    assert_intact,
    chunk_blocks,
    grid,
    new_hashes,
    object_keys,
    row,
)


@dataclass
class Baseline:
    """A node with two stored chunks, and what must still be true after a bad request."""

    node: Node
    engine: Engine
    hashes: list[bytes]
    stored: dict[bytes, bytes]
    before: np.ndarray[Any, Any]

    def assert_intact(self) -> None:
        assert_intact(self.node, self.engine, self.before, self.stored)

    def code(self, method: str, request: Any) -> str:
        return self.node.error(method, request).code().name


@pytest.fixture
def base(node: Node, engine: Engine) -> Baseline:
    hashes = new_hashes(2)
    blocks = chunk_blocks(0) + chunk_blocks(1)
    node.store(engine, hashes, blocks)
    stored = {h: engine.chunk(chunk_blocks(i)) for i, h in enumerate(hashes)}
    return Baseline(node, engine, hashes, stored, engine.snapshot())


def store_request(engine: Engine, **overrides: Any) -> storage_pb2.StoreChunksRequest:
    fields: dict[str, Any] = {
        "engine_id": engine.engine_id,
        "keys": row(new_hashes(2)),
        "block_ids": chunk_blocks(2) + chunk_blocks(3),
        "chunk_tokens": CHUNK_TOKENS,
    }
    fields.update(overrides)
    return storage_pb2.StoreChunksRequest(**fields)


def retrieve_request(base: Baseline, **overrides: Any) -> storage_pb2.RetrieveChunksRequest:
    fields: dict[str, Any] = {
        "engine_id": base.engine.engine_id,
        "keys": row(base.hashes),
        "block_ids": chunk_blocks(0, 40) + chunk_blocks(1, 40),
        "chunk_tokens": CHUNK_TOKENS,
    }
    fields.update(overrides)
    return storage_pb2.RetrieveChunksRequest(**fields)


# -- store and retrieve block ids / chunk geometry -----------------------------------------

OUT_OF_RANGE = {
    "num_blocks": [NUM_BLOCKS, 1, 2, 3],
    "last_id_of_a_later_chunk": [0, 1, 2, NUM_BLOCKS + 5],
    "uint32_max": [0, 1, 2**32 - 1, 3],
}


@pytest.mark.parametrize("block_ids", OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_store_with_an_out_of_range_block_id_is_invalid(
    base: Baseline, block_ids: list[int]
) -> None:
    assert base.code("store_chunks", store_request(base.engine, block_ids=block_ids)) == (
        "INVALID_ARGUMENT"
    )
    base.assert_intact()


@pytest.mark.parametrize("block_ids", OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_retrieve_with_an_out_of_range_block_id_is_invalid(
    base: Baseline, block_ids: list[int]
) -> None:
    assert base.code("retrieve_chunks", retrieve_request(base, block_ids=block_ids)) == (
        "INVALID_ARGUMENT"
    )
    base.assert_intact()


@pytest.mark.parametrize(
    ("start", "end"), [(0, 0), (1, 1), (1, 0), (0, NUM_LAYERS + 1), (NUM_LAYERS, NUM_LAYERS + 1)]
)
def test_retrieve_of_a_layer_range_outside_the_engines_layers_is_invalid(
    base: Baseline, start: int, end: int
) -> None:
    lease = base.node.lookup(base.hashes).prefetch_id
    request = retrieve_request(
        base, layers=common_pb2.LayerRange(start=start, end=end), lease_id=lease
    )
    error = base.node.error("retrieve_chunks", request)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"{NUM_LAYERS} layers" in (error.details() or "")
    # Refused before the lease gave up its locks: they still hold both chunks.
    assert base.node.status().leases.held_locks == 2
    base.node.call("release_lease", storage_pb2.ReleaseLeaseRequest(lease_id=lease, end=True))
    base.assert_intact()


def test_store_with_too_few_block_ids_is_invalid(base: Baseline) -> None:
    request = store_request(base.engine, block_ids=[*chunk_blocks(2), chunk_blocks(3)[0]])
    assert base.code("store_chunks", request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_retrieve_with_too_few_block_ids_is_invalid(base: Baseline) -> None:
    request = retrieve_request(base, block_ids=chunk_blocks(0, 40))
    assert base.code("retrieve_chunks", request) == "INVALID_ARGUMENT"
    base.assert_intact()


@pytest.mark.parametrize("chunk_tokens", [24, 8, 0], ids=["1.5_blocks", "half_block", "zero"])
def test_store_with_chunk_tokens_not_a_multiple_of_the_block_size_is_invalid(
    base: Baseline, chunk_tokens: int
) -> None:
    request = store_request(base.engine, chunk_tokens=chunk_tokens)
    assert base.code("store_chunks", request) == "INVALID_ARGUMENT"
    base.assert_intact()


@pytest.mark.parametrize("chunk_tokens", [24, 0], ids=["1.5_blocks", "zero"])
def test_retrieve_with_chunk_tokens_not_a_multiple_of_the_block_size_is_invalid(
    base: Baseline, chunk_tokens: int
) -> None:
    request = retrieve_request(base, chunk_tokens=chunk_tokens)
    assert base.code("retrieve_chunks", request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_retrieve_with_skip_beyond_the_chunks_is_invalid(base: Baseline) -> None:
    request = retrieve_request(base, skip_first_n_tokens=2 * CHUNK_TOKENS + 1)
    assert base.code("retrieve_chunks", request) == "INVALID_ARGUMENT"
    base.assert_intact()


def _end_lease(base: Baseline, lease_id: str) -> int:
    ended = base.node.call(
        "release_lease", storage_pb2.ReleaseLeaseRequest(lease_id=lease_id, end=True)
    )
    return int(ended.released_locks)


def test_rejected_retrieve_uses_none_of_its_leases_locks(base: Baseline) -> None:
    lease = base.node.lookup(base.hashes).prefetch_id
    request = retrieve_request(base, skip_first_n_tokens=2 * CHUNK_TOKENS + 1, lease_id=lease)
    assert base.code("retrieve_chunks", request) == "INVALID_ARGUMENT"
    assert base.node.read_locked_objects() == 2  # the lease still holds both
    assert _end_lease(base, lease) == 2
    base.assert_intact()


def test_a_retrieve_naming_an_unknown_lease_copies_and_releases_nothing_else(
    base: Baseline,
) -> None:
    lease = base.node.lookup(base.hashes).prefetch_id
    request = retrieve_request(base, lease_id="prefetch-1-0ldincarnation")
    assert base.node.call("retrieve_chunks", request).retrieved_chunks == 2
    assert base.node.read_locked_objects() == 2  # another lease's locks are untouched
    assert _end_lease(base, lease) == 2
    assert base.node.read_locked_objects() == 0


def test_store_of_more_chunks_than_the_node_allows_is_invalid(base: Baseline) -> None:
    n = 65  # the fixture's node allows 64
    request = store_request(
        base.engine,
        keys=row(new_hashes(n)),
        block_ids=[i % NUM_BLOCKS for i in range(n * BLOCKS_PER_CHUNK)],
    )
    assert base.code("store_chunks", request) == "INVALID_ARGUMENT"
    base.assert_intact()


@pytest.mark.parametrize("method", ["retrieve_chunks", "lookup_and_lock", "prepare_store"])
def test_other_requests_over_the_chunk_limit_are_invalid(base: Baseline, method: str) -> None:
    hashes = new_hashes(65)
    request: Any
    if method == "retrieve_chunks":
        request = retrieve_request(
            base,
            keys=row(hashes),
            block_ids=[i % NUM_BLOCKS for i in range(65 * BLOCKS_PER_CHUNK)],
        )
    elif method == "lookup_and_lock":
        request = storage_pb2.LookupAndLockRequest(keys=grid(hashes, range(9)))
    else:
        request = storage_pb2.PrepareStoreRequest(keys=row(hashes), chunk_bytes=CHUNK_BYTES)
    assert base.code(method, request) == "INVALID_ARGUMENT"
    base.assert_intact()


# -- engine registration -------------------------------------------------------------------


def registered(node: Node) -> list[str]:
    return list(node.status().engine_ids)


def _bad_registrations(
    engine: Engine, dirs: ShmDirs, tmp_path: Path
) -> dict[str, storage_pb2.RegisterEngineMemoryRequest]:
    """Each a request for a new engine id that must be refused with INVALID_ARGUMENT."""
    outside = tmp_path / "outside-kv"
    outside.write_bytes(b"\x11" * (LAYER_BYTES * NUM_LAYERS))
    link = dirs.engine / "link-to-outside"
    link.symlink_to(outside)
    subdir = dirs.engine / "a-directory"
    subdir.mkdir()
    new = "engine-new"

    def req(**kw: Any) -> storage_pb2.RegisterEngineMemoryRequest:
        return engine.register_request(engine_id=new, **kw)

    escaped = f"{dirs.engine}/../engine/{engine.path.name}"
    return {
        "size_bytes_one_element_short": req(layers=engine.handles(size_bytes=LAYER_BYTES - 2)),
        "size_bytes_of_two_layers": req(layers=engine.handles(size_bytes=2 * LAYER_BYTES)),
        "dtype_unspecified": req(layout=engine.layout(dtype=common_pb2.DTYPE_UNSPECIFIED)),
        "kind_unspecified": req(layout=engine.layout(kind=common_pb2.KV_LAYOUT_KIND_UNSPECIFIED)),
        # The file holds fp16; declared fp32, every layer is twice as large as the handle says.
        "dtype_wider_than_the_memory": req(layout=engine.layout(dtype=common_pb2.DTYPE_FLOAT32)),
        "more_blocks_than_the_handles_hold": req(layout=engine.layout(num_blocks=NUM_BLOCKS * 2)),
        "fewer_handles_than_layers": req(layout=engine.layout(num_layers=NUM_LAYERS + 1)),
        "zero_block_size": req(layout=engine.layout(block_size=0)),
        "region_beyond_the_end_of_the_file": req(layers=engine.handles(offset=LAYER_BYTES)),
        "offset_not_aligned_to_the_dtype": req(layers=engine.handles(offset=1)),
        "missing_file": req(layers=engine.handles(path=str(dirs.engine / "no-such-file"))),
        "path_outside_the_allowed_dir": req(layers=engine.handles(path=str(outside))),
        "symlink_pointing_outside": req(layers=engine.handles(path=str(link))),
        "dot_dot_in_the_path": req(layers=engine.handles(path=escaped)),
        "a_directory": req(layers=engine.handles(path=str(subdir))),
        "a_layer_without_a_handle": req(layers=[common_pb2.MemoryHandle()] * NUM_LAYERS),
        "empty_engine_id": engine.register_request(engine_id=""),
    }


BAD_REGISTRATIONS = [
    "size_bytes_one_element_short",
    "size_bytes_of_two_layers",
    "dtype_unspecified",
    "kind_unspecified",
    "dtype_wider_than_the_memory",
    "more_blocks_than_the_handles_hold",
    "fewer_handles_than_layers",
    "zero_block_size",
    "region_beyond_the_end_of_the_file",
    "offset_not_aligned_to_the_dtype",
    "missing_file",
    "path_outside_the_allowed_dir",
    "symlink_pointing_outside",
    "dot_dot_in_the_path",
    "a_directory",
    "a_layer_without_a_handle",
    "empty_engine_id",
]


@pytest.mark.parametrize("case", BAD_REGISTRATIONS)
def test_bad_registration_is_invalid_and_maps_nothing(
    base: Baseline, shm_dirs: ShmDirs, tmp_path: Path, case: str
) -> None:
    requests = _bad_registrations(base.engine, shm_dirs, tmp_path)
    assert set(requests) == set(BAD_REGISTRATIONS)
    assert base.code("register_engine_memory", requests[case]) == "INVALID_ARGUMENT"
    assert registered(base.node) == [base.engine.engine_id]
    outside = tmp_path / "outside-kv"
    assert outside.read_bytes() == b"\x11" * (LAYER_BYTES * NUM_LAYERS)
    # The refused engine cannot be used.
    request = store_request(base.engine, engine_id="engine-new")
    assert base.code("store_chunks", request) == "FAILED_PRECONDITION"
    base.assert_intact()


def test_re_register_with_a_different_layout_is_already_exists(base: Baseline) -> None:
    # Half the blocks at the same memory: a valid layout on its own, but not the one registered.
    changed = base.engine.register_request(
        layout=base.engine.layout(num_blocks=NUM_BLOCKS // 2),
        layers=base.engine.handles(size_bytes=LAYER_BYTES // 2),
    )
    assert base.code("register_engine_memory", changed) == "ALREADY_EXISTS"
    other_memory = base.engine.register_request(layers=base.engine.handles()[::-1])
    assert base.code("register_engine_memory", other_memory) == "ALREADY_EXISTS"
    # The first registration still works in full: a chunk at the last blocks round-trips.
    last = [NUM_BLOCKS - 2, NUM_BLOCKS - 1]
    hashes = new_hashes(1)
    assert base.node.store(base.engine, hashes, last) == [storage_pb2.STORE_OUTCOME_STORED]
    base.stored[hashes[0]] = base.engine.chunk(last)
    base.assert_intact()


@pytest.mark.parametrize("method", ["store_chunks", "retrieve_chunks"])
def test_data_path_of_an_unregistered_engine_is_failed_precondition(
    base: Baseline, method: str
) -> None:
    request: Any = (
        store_request(base.engine, engine_id="never-registered")
        if method == "store_chunks"
        else retrieve_request(base, engine_id="never-registered")
    )
    assert base.code(method, request) == "FAILED_PRECONDITION"
    base.assert_intact()


def test_store_after_unregister_is_failed_precondition(base: Baseline) -> None:
    base.node.call(
        "unregister_engine_memory",
        storage_pb2.UnregisterEngineMemoryRequest(engine_id=base.engine.engine_id),
    )
    assert base.code("store_chunks", store_request(base.engine)) == "FAILED_PRECONDITION"
    assert base.engine.engine_id not in registered(base.node)
    # L1 keeps what the engine stored before it left.
    assert_intact(base.node, base.engine, base.before, base.stored)


# -- keys ----------------------------------------------------------------------------------


def _requests_with_keys(
    base: Baseline, hashes: list[bytes], salt: str, model: str
) -> dict[str, Any]:
    """One request per key-carrying RPC, all naming the given (possibly bad) keys."""
    keys_row = row(hashes, salt=salt, model=model)
    keys_grid = grid(hashes, salt=salt, model=model)
    return {
        "store_chunks": store_request(base.engine, keys=keys_row),
        "retrieve_chunks": retrieve_request(base, keys=keys_row),
        "lookup_and_lock": storage_pb2.LookupAndLockRequest(keys=keys_grid),
        "release_locks": storage_pb2.ReleaseLocksRequest(keys=keys_grid),
        "touch_keys": storage_pb2.TouchKeysRequest(keys=keys_grid),
        "delete_keys": storage_pb2.DeleteKeysRequest(
            keys=object_keys(hashes, salt=salt, model=model), tier=common_pb2.TIER_ALL, force=True
        ),
        "prepare_store": storage_pb2.PrepareStoreRequest(keys=keys_row, chunk_bytes=CHUNK_BYTES),
        "prepare_retrieve": storage_pb2.PrepareRetrieveRequest(
            keys=keys_row, chunk_bytes=CHUNK_BYTES
        ),
    }


KEY_METHODS = [
    "store_chunks",
    "retrieve_chunks",
    "lookup_and_lock",
    "release_locks",
    "touch_keys",
    "delete_keys",
    "prepare_store",
    "prepare_retrieve",
]


@pytest.mark.parametrize("method", KEY_METHODS)
@pytest.mark.parametrize("length", [31, 33, 0])
def test_a_chunk_hash_of_the_wrong_length_is_invalid(
    base: Baseline, method: str, length: int
) -> None:
    # A valid stored key first, then the bad one: nothing of the request may apply.
    hashes = [base.hashes[0], os.urandom(length)]
    request = _requests_with_keys(base, hashes, "", "test/model")[method]
    assert base.code(method, request) == "INVALID_ARGUMENT"
    base.assert_intact()


@pytest.mark.parametrize("method", KEY_METHODS)
@pytest.mark.parametrize(
    "salt", ["a/b", "a@b", "a\\b", "x" * 129], ids=["slash", "at", "bs", "long"]
)
def test_a_bad_cache_salt_is_invalid(base: Baseline, method: str, salt: str) -> None:
    request = _requests_with_keys(base, base.hashes, salt, "test/model")[method]
    assert base.code(method, request) == "INVALID_ARGUMENT"
    base.assert_intact()


@pytest.mark.parametrize("method", ["store_chunks", "lookup_and_lock", "delete_keys"])
@pytest.mark.parametrize("model", ["", "m@x", "m" * 513], ids=["empty", "at", "long"])
def test_a_bad_model_name_is_invalid(base: Baseline, method: str, model: str) -> None:
    request = _requests_with_keys(base, base.hashes, "", model)[method]
    assert base.code(method, request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_lookup_without_kv_ranks_is_invalid(base: Baseline) -> None:
    request = storage_pb2.LookupAndLockRequest(keys=grid(base.hashes, ()))
    assert base.code("lookup_and_lock", request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_lookup_with_a_repeated_kv_rank_is_invalid_and_locks_nothing(base: Baseline) -> None:
    request = storage_pb2.LookupAndLockRequest(keys=grid(base.hashes, (0, 0)), num_kv_readers=128)
    assert base.code("lookup_and_lock", request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_lookup_with_too_many_readers_is_invalid(base: Baseline) -> None:
    request = storage_pb2.LookupAndLockRequest(keys=grid(base.hashes), num_kv_readers=129)
    assert base.code("lookup_and_lock", request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_delete_of_more_than_ten_thousand_keys_is_invalid(base: Baseline) -> None:
    keys = object_keys([*base.hashes, *new_hashes(10_000 - 1)])
    request = storage_pb2.DeleteKeysRequest(keys=keys, tier=common_pb2.TIER_ALL, force=True)
    assert base.code("delete_keys", request) == "INVALID_ARGUMENT"
    base.assert_intact()


# -- ids -----------------------------------------------------------------------------------


def test_status_of_an_unknown_prefetch_is_not_found(base: Baseline) -> None:
    request = storage_pb2.GetPrefetchStatusRequest(prefetch_id="prefetch-404-deadbeef")
    assert base.code("get_prefetch_status", request) == "NOT_FOUND"
    released = base.node.call(
        "release_prefetch", storage_pb2.ReleasePrefetchRequest(prefetch_id="prefetch-404")
    )
    assert not released.existed  # idempotent, not an error
    base.assert_intact()


@pytest.mark.parametrize("method", ["commit_store", "commit_retrieve"])
def test_commit_of_an_unknown_transaction_is_not_found(base: Baseline, method: str) -> None:
    request: Any = (
        storage_pb2.CommitStoreRequest(transaction_id="store-404")
        if method == "commit_store"
        else storage_pb2.CommitRetrieveRequest(transaction_id="read-404")
    )
    lease = base.node.lookup(base.hashes).prefetch_id
    if method == "commit_retrieve":
        request.lease_id = lease
    assert base.code(method, request) == "NOT_FOUND"
    assert base.node.read_locked_objects() == 2  # the unknown commit released nothing
    assert _end_lease(base, lease) == 2
    base.assert_intact()


def test_commit_store_twice_commits_nothing_more_and_keeps_the_chunks(base: Baseline) -> None:
    hashes = new_hashes(1)
    prepared = base.node.call(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(hashes), chunk_bytes=CHUNK_BYTES)
    )
    request = storage_pb2.CommitStoreRequest(transaction_id=prepared.transaction_id)
    assert base.node.call("commit_store", request).committed_chunks == 1
    assert base.node.call("commit_store", request).committed_chunks == 0  # a retried commit
    assert base.node.l1_hashes() == {*base.hashes, *hashes}


def test_commit_of_a_never_prepared_store_is_not_found(base: Baseline) -> None:
    request = storage_pb2.CommitStoreRequest(transaction_id="store-never-prepared")
    assert base.code("commit_store", request) == "NOT_FOUND"
    base.assert_intact()


@pytest.mark.parametrize("method", ["prepare_store", "prepare_retrieve"])
@pytest.mark.parametrize("chunk_bytes", [0, (1 << 31) + 1], ids=["zero", "over_2GiB"])
def test_engine_driven_prepare_with_bad_chunk_bytes_is_invalid(
    base: Baseline, method: str, chunk_bytes: int
) -> None:
    keys = row(new_hashes(1) if method == "prepare_store" else base.hashes)
    request: Any = (
        storage_pb2.PrepareStoreRequest(keys=keys, chunk_bytes=chunk_bytes)
        if method == "prepare_store"
        else storage_pb2.PrepareRetrieveRequest(keys=keys, chunk_bytes=chunk_bytes)
    )
    assert base.code(method, request) == "INVALID_ARGUMENT"
    base.assert_intact()


# -- message size --------------------------------------------------------------------------


def test_a_message_over_the_servers_limit_is_resource_exhausted(
    make_node: NodeFactory, engine: Engine
) -> None:
    node = make_node(max_message_bytes=1 << 20)
    node.register(engine)
    hashes = new_hashes(2)
    node.store(engine, hashes, chunk_blocks(0) + chunk_blocks(1))
    before = engine.snapshot()
    stored = {h: engine.chunk(chunk_blocks(i)) for i, h in enumerate(hashes)}

    # 5 000 valid keys (under the 10 000-key limit), ~1.6 MiB on the wire, the stored ones
    # among them: were it accepted, it would delete them.
    keys = object_keys(hashes) + [
        common_pb2.ObjectKey(chunk_hash=os.urandom(32), model_name="m" * 300) for _ in range(4_998)
    ]
    request = storage_pb2.DeleteKeysRequest(keys=keys, tier=common_pb2.TIER_ALL, force=True)
    assert request.ByteSize() > 1 << 20
    error = node.error("delete_keys", request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (error.details() or "")
    assert_intact(node, engine, before, stored)
    # The connection still serves normal requests.
    assert (
        node.call(
            "delete_keys",
            storage_pb2.DeleteKeysRequest(keys=object_keys(hashes[:1]), tier=common_pb2.TIER_L1),
        ).deleted
        == 1
    )
