"""Every bad engine request gets its status code, and nothing is stored, lost or corrupted.

Each test starts from a gateway and node holding two stored chunks of a
registered engine and a request (``held``) whose lookup holds their read
locks. It sends one bad request and checks the status code (and, where a
machine needs it, the ErrorInfo reason or the storage message relayed
unchanged). Then it checks that the engine's memory is byte-for-byte
unchanged, that L1 holds the same keys with the same bytes, and that the
held lookup's locks are exactly as they were: ending its session releases
both, and nothing stays locked.

Most refusals are the gateway core's own, the same whatever the transport:
they run under the default arrangement. Those marked ``transports`` run under
all four: storage's errors relayed through the link, ErrorInfo details, a
storage node that is down, and waits refused well inside the caller's deadline.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.rpc.interceptors import error_info
from tests.integration.gateway.conftest import StackFactory
from tests.integration.gateway.support import (
    CHUNK,
    MODEL,
    NUM_BLOCKS,
    Engine,
    Stack,
    blocks,
    code_of,
    hashes_of,
    prange,
    prompt,
)
from tests.support.harness import ServerThread
from tests.support.ports import free_port


@dataclass
class Baseline:
    """Two stored chunks, a lookup holding their locks, and what must stay true."""

    stack: Stack
    engine: Engine
    tokens: list[int]
    hashes: list[bytes]
    stored: list[bytes]
    before: np.ndarray[Any, Any]

    def code(self, method: str, request: Any) -> str:
        return code_of(self.stack.error(method, request))

    def assert_intact(self) -> None:
        stack = self.stack
        assert np.array_equal(np.asarray(self.engine.kv), self.before), "engine memory changed"
        assert stack.l1() == set(self.hashes), "L1 contents changed"
        assert stack.l1_bytes(self.hashes) == self.stored, "L1 bytes changed"
        assert stack.locked() == 2, "the held lookup's locks changed"
        assert stack.end_session("held").released_locks == 2, "lock accounting is off"
        assert stack.locked() == 0, "a lock was left behind"


@pytest.fixture
def base(ready: Stack, engine: Engine) -> Baseline:
    tokens = prompt(2, extra=5)
    ready.store(engine, "writer", tokens, 0, 2 * CHUNK, blocks(range(2)))
    assert ready.lookup("held", tokens).status.hit_chunks == 2
    stored = [engine.chunk(blocks([c])) for c in range(2)]
    return Baseline(ready, engine, tokens, hashes_of(tokens), stored, engine.snapshot())


def store_request(base: Baseline, **overrides: Any) -> gateway_pb2.StoreRequest:
    """A store of a fresh 2-chunk prompt (fields overridable)."""
    fields: dict[str, Any] = {
        "engine_id": base.engine.engine_id,
        "range": prange("new", prompt(2), 0, 2 * CHUNK),
        "block_ids": blocks(range(2), base=20),
    }
    fields.update(overrides)
    return gateway_pb2.StoreRequest(**fields)


def retrieve_request(base: Baseline, **overrides: Any) -> gateway_pb2.RetrieveRequest:
    """A retrieve of the held request's two chunks into blocks 40.. (fields overridable)."""
    fields: dict[str, Any] = {
        "engine_id": base.engine.engine_id,
        "range": prange("held", base.tokens, 0, 2 * CHUNK),
        "block_ids": blocks(range(2), base=40),
    }
    fields.update(overrides)
    return gateway_pb2.RetrieveRequest(**fields)


def data_request(base: Baseline, method: str, **overrides: Any) -> Any:
    return (store_request if method == "store" else retrieve_request)(base, **overrides)


# -- unknown request ids --------------------------------------------------------------------

UNKNOWN_REQUEST = {
    "query_prefetch_status": gateway_pb2.QueryPrefetchStatusRequest(request_id="nobody"),
    "wait_prefetch_status": gateway_pb2.WaitPrefetchStatusRequest(
        request_id="nobody", timeout_ms=100
    ),
    "free_lookup_locks": gateway_pb2.FreeLookupLocksRequest(
        request_id="nobody", start_token=0, end_token=CHUNK
    ),
}


@pytest.mark.transports  # ErrorInfo through each transport
@pytest.mark.parametrize("method", UNKNOWN_REQUEST)
def test_an_unknown_request_id_is_not_found(base: Baseline, method: str) -> None:
    error = base.stack.error(method, UNKNOWN_REQUEST[method])
    assert code_of(error) == "NOT_FOUND"
    info = error_info(error)
    assert info is not None
    assert info.reason == "UNKNOWN_REQUEST"
    base.assert_intact()


def test_a_request_that_stored_but_never_looked_up_has_no_prefetch_status(base: Baseline) -> None:
    request = gateway_pb2.QueryPrefetchStatusRequest(request_id="writer")
    assert base.code("query_prefetch_status", request) == "NOT_FOUND"
    base.assert_intact()


# -- token ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["store", "retrieve"])
def test_a_range_beyond_the_prompt_is_invalid(base: Baseline, method: str) -> None:
    tokens = prompt(1, extra=10)
    request = data_request(base, method, range=prange("short", tokens, 0, 2 * CHUNK))
    assert base.code(method, request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_a_lookup_end_token_beyond_the_prompt_is_invalid(base: Baseline) -> None:
    error = base.stack.error(
        "lookup",
        gateway_pb2.LookupRequest(
            request_id="held", model_name=MODEL, world_size=1, token_ids=base.tokens,
            end_token=len(base.tokens) + 1,
        ),
    )  # fmt: skip
    assert code_of(error) == "INVALID_ARGUMENT"
    base.assert_intact()  # the held lookup was not replaced


def test_freeing_locks_beyond_the_prompt_is_invalid(base: Baseline) -> None:
    request = gateway_pb2.FreeLookupLocksRequest(
        request_id="held", start_token=0, end_token=4 * CHUNK
    )
    assert base.code("free_lookup_locks", request) == "INVALID_ARGUMENT"
    base.assert_intact()


UNALIGNED = {"start": (10, 2 * CHUNK), "end": (0, CHUNK + 10), "reversed": (2 * CHUNK, CHUNK)}


@pytest.mark.parametrize("method", ["store", "retrieve"])
@pytest.mark.parametrize("bounds", UNALIGNED.values(), ids=UNALIGNED.keys())
def test_a_range_not_aligned_to_chunks_is_invalid(
    base: Baseline, method: str, bounds: tuple[int, int]
) -> None:
    start, end = bounds
    rid = "new" if method == "store" else "held"
    tokens = prompt(2) if method == "store" else base.tokens
    request = data_request(base, method, range=prange(rid, tokens, start, end))
    assert base.code(method, request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_freeing_locks_of_a_range_not_aligned_to_chunks_is_invalid(base: Baseline) -> None:
    request = gateway_pb2.FreeLookupLocksRequest(request_id="held", start_token=5, end_token=CHUNK)
    assert base.code("free_lookup_locks", request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_skip_beyond_the_range_is_invalid(base: Baseline) -> None:
    request = retrieve_request(base, skip_first_n_tokens=2 * CHUNK + 1)
    assert base.code("retrieve", request) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_a_range_of_another_model_than_the_engines_is_invalid(base: Baseline) -> None:
    request = store_request(base, range=prange("new", prompt(2), 0, 2 * CHUNK, model="other"))
    assert base.code("store", request) == "INVALID_ARGUMENT"
    base.assert_intact()


# -- engines --------------------------------------------------------------------------------


@pytest.mark.transports  # ErrorInfo through each transport
@pytest.mark.parametrize("method", ["store", "retrieve"])
def test_the_data_path_of_an_unregistered_engine_is_failed_precondition(
    base: Baseline, method: str
) -> None:
    error = base.stack.error(method, data_request(base, method, engine_id="never-registered"))
    assert code_of(error) == "FAILED_PRECONDITION"
    info = error_info(error)
    assert info is not None
    assert info.reason == "ENGINE_NOT_REGISTERED"
    base.assert_intact()


@pytest.mark.parametrize("method", ["prepare_store", "prepare_retrieve"])
def test_the_engine_driven_path_of_an_lmcache_driven_engine_is_failed_precondition(
    base: Baseline, method: str
) -> None:
    request_type = (
        gateway_pb2.PrepareStoreRequest
        if method == "prepare_store"
        else gateway_pb2.PrepareRetrieveRequest
    )
    request = request_type(
        engine_id=base.engine.engine_id, range=prange("held", base.tokens, 0, 2 * CHUNK)
    )
    assert base.code(method, request) == "FAILED_PRECONDITION"
    base.assert_intact()


def register_request(engine: Engine, **overrides: Any) -> gateway_pb2.RegisterKVCacheRequest:
    layout = overrides.pop("layout", {})
    fields: dict[str, Any] = {
        "engine_id": "engine-new",
        "model_name": MODEL,
        "world_size": 1,
        "worker_id": 0,
        "layout": engine.layout(**layout),
        "layers": engine.handles(),
    }
    fields.update(overrides)
    return gateway_pb2.RegisterKVCacheRequest(**fields)


def assert_not_registered(base: Baseline, engine_id: str = "engine-new") -> None:
    assert not base.stack.client.ping(gateway_pb2.PingRequest(engine_id=engine_id)).engine_known
    assert list(base.stack.node.status().engine_ids) == [base.engine.engine_id]


@pytest.mark.parametrize("block_size", [24, 128])
def test_a_block_size_that_does_not_divide_the_chunk_is_chunk_size_mismatch(
    base: Baseline, block_size: int
) -> None:
    request = register_request(
        base.engine, layout={"block_size": block_size, "num_blocks": NUM_BLOCKS * 16 // block_size}
    )
    error = base.stack.error("register_kv_cache", request)
    assert code_of(error) == "INVALID_ARGUMENT"
    info = error_info(error)
    assert info is not None
    assert info.reason == "CHUNK_SIZE_MISMATCH"
    assert info.metadata["field"] == "layout.block_size"
    assert_not_registered(base)
    base.assert_intact()


def test_an_engine_context_whose_block_size_does_not_divide_the_chunk_is_chunk_size_mismatch(
    base: Baseline,
) -> None:
    request = gateway_pb2.RegisterEngineContextRequest(
        engine_id="ctx-new", model_name=MODEL, world_size=1, worker_id=0,
        layout=gateway_pb2.EngineContextLayout(
            num_layers=2, block_size=48, kv_heads=2, head_dim=8, dtype=common_pb2.DTYPE_FLOAT16
        ),
    )  # fmt: skip
    error = base.stack.error("register_engine_context", request)
    assert code_of(error) == "INVALID_ARGUMENT"
    info = error_info(error)
    assert info is not None
    assert info.reason == "CHUNK_SIZE_MISMATCH"
    assert not base.stack.client.ping(gateway_pb2.PingRequest(engine_id="ctx-new")).engine_known
    base.assert_intact()


@pytest.mark.parametrize(
    ("layers", "heads", "dim", "field"),
    [
        (100_000, 2, 8, "layout.num_layers"),
        (2, 2**20, 8, "layout.kv_heads"),
        (4000, 64, 128, "layout"),  # every dimension allowed, the chunk 33 GB
    ],
    ids=["layers", "heads", "chunk"],
)
def test_an_engine_context_larger_than_storage_holds_is_invalid(
    base: Baseline, layers: int, heads: int, dim: int, field: str
) -> None:
    request = gateway_pb2.RegisterEngineContextRequest(
        engine_id="ctx-huge", model_name=MODEL, world_size=1, worker_id=0,
        layout=gateway_pb2.EngineContextLayout(
            num_layers=layers, block_size=16, kv_heads=heads, head_dim=dim,
            dtype=common_pb2.DTYPE_FLOAT16,
        ),
    )  # fmt: skip
    error = base.stack.error("register_engine_context", request)
    assert code_of(error) == "INVALID_ARGUMENT"
    info = error_info(error)
    assert info is not None
    assert info.metadata["field"] == field
    assert not base.stack.client.ping(gateway_pb2.PingRequest(engine_id="ctx-huge")).engine_known
    base.assert_intact()


def test_an_engine_holding_the_models_kv_in_another_dtype_is_refused_while_one_is_registered(
    base: Baseline, make_engine: Callable[..., Engine]
) -> None:
    other = make_engine()
    error = base.stack.error(
        "register_kv_cache",
        gateway_pb2.RegisterKVCacheRequest(
            engine_id=other.engine_id, model_name=MODEL, world_size=1, worker_id=0,
            layout=other.layout(dtype=common_pb2.DTYPE_BFLOAT16), layers=other.handles(),
        ),
    )  # fmt: skip
    assert code_of(error) == "FAILED_PRECONDITION"
    info = error_info(error)
    assert info is not None
    assert info.reason == "MODEL_KV_FORMAT_CONFLICT"
    assert "DTYPE_FLOAT16" in (error.details() or "")
    assert "another model_name" in (error.details() or "")
    assert not base.stack.client.ping(
        gateway_pb2.PingRequest(engine_id=other.engine_id)
    ).engine_known
    base.assert_intact()
    # The same dtype is welcome.
    assert not base.stack.register(other).already_registered


BAD_LAYOUTS: dict[str, tuple[dict[str, Any], str, str]] = {
    # case: (request overrides, ErrorInfo field, text of storage's message)
    "unspecified_dtype": (
        {"layout": {"dtype": common_pb2.DTYPE_UNSPECIFIED}},
        "layout.dtype",
        "layout.dtype must be specified",
    ),
    "unspecified_kind": (
        {"layout": {"kind": common_pb2.KV_LAYOUT_KIND_UNSPECIFIED}},
        "layout.kind",
        "layout.kind must be specified",
    ),
    "layer_size_mismatch": (
        {"layout": {"num_blocks": NUM_BLOCKS * 2}},
        "handles[0].size_bytes",
        "handles[0].size_bytes is",
    ),
}


@pytest.mark.transports  # storage's error relayed
@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_a_bad_layout_is_invalid_with_storages_message_relayed(base: Baseline, case: str) -> None:
    overrides, field, text = BAD_LAYOUTS[case]
    error = base.stack.error("register_kv_cache", register_request(base.engine, **overrides))
    assert code_of(error) == "INVALID_ARGUMENT"
    assert text in error.details()  # type: ignore[attr-defined]
    info = error_info(error)
    assert info is not None
    assert info.metadata["field"] == field
    assert_not_registered(base)
    base.assert_intact()


def test_a_registration_without_a_layout_is_invalid(base: Baseline) -> None:
    request = gateway_pb2.RegisterKVCacheRequest(
        engine_id="engine-new", model_name=MODEL, world_size=1, layers=base.engine.handles()
    )
    assert base.code("register_kv_cache", request) == "INVALID_ARGUMENT"
    assert_not_registered(base)
    base.assert_intact()


@pytest.mark.parametrize(
    "overrides",
    [{"worker_id": 1}, {"world_size": 0}, {"model_name": "a@b"}, {"engine_id": ""}],
    ids=["worker_outside_world", "world_size_0", "model_name_with_at", "empty_engine_id"],
)
def test_bad_registration_fields_are_invalid(base: Baseline, overrides: dict[str, Any]) -> None:
    request = register_request(base.engine, **overrides)
    assert base.code("register_kv_cache", request) == "INVALID_ARGUMENT"
    assert_not_registered(base)
    base.assert_intact()


# -- block ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["store", "retrieve"])
def test_too_few_block_ids_is_invalid(base: Baseline, method: str) -> None:
    request = data_request(base, method, block_ids=blocks(range(2))[:-1])
    assert base.code(method, request) == "INVALID_ARGUMENT"
    base.assert_intact()


@pytest.mark.transports  # storage's refusal relayed
@pytest.mark.parametrize("method", ["store", "retrieve"])
def test_a_block_id_out_of_range_is_invalid_with_storages_message_relayed(
    base: Baseline, method: str
) -> None:
    ids = blocks(range(2), base=40)
    ids[5] = NUM_BLOCKS + 3
    error = base.stack.error(method, data_request(base, method, block_ids=ids))
    assert code_of(error) == "INVALID_ARGUMENT"
    assert f"= {NUM_BLOCKS + 3} is outside the engine's {NUM_BLOCKS} blocks" in error.details()  # type: ignore[attr-defined]
    info = error_info(error)
    assert info is not None
    assert info.metadata["field"] == "block_ids"
    base.assert_intact()


# -- names, limits --------------------------------------------------------------------------

BAD_SALTS = ["tenant/a", "a@b", "x" * 129]


@pytest.mark.parametrize("salt", BAD_SALTS, ids=["slash", "at", "too_long"])
@pytest.mark.parametrize("method", ["lookup", "store", "retrieve"])
def test_a_bad_cache_salt_is_invalid(base: Baseline, method: str, salt: str) -> None:
    request: Any
    if method == "lookup":
        request = gateway_pb2.LookupRequest(
            request_id="salted", model_name=MODEL, world_size=1, cache_salt=salt,
            token_ids=base.tokens,
        )  # fmt: skip
    else:
        rid = "new" if method == "store" else "held"
        tokens = prompt(2) if method == "store" else base.tokens
        request = data_request(base, method, range=prange(rid, tokens, 0, 2 * CHUNK, salt=salt))
    error = base.stack.error(method, request)
    assert code_of(error) == "INVALID_ARGUMENT"
    info = error_info(error)
    assert info is not None
    assert "cache_salt" in info.metadata["field"]
    base.assert_intact()


LOOKUP_CASES: dict[str, dict[str, Any]] = {
    "empty_request_id": {"request_id": ""},
    "model_name_with_at": {"model_name": "m@x"},
    "world_size_0": {"world_size": 0},
    "too_many_readers": {"num_kv_readers": 129},
}


@pytest.mark.parametrize("case", LOOKUP_CASES)
def test_a_bad_lookup_is_invalid(base: Baseline, case: str) -> None:
    fields: dict[str, Any] = {
        "request_id": "other",
        "model_name": MODEL,
        "world_size": 1,
        "token_ids": base.tokens,
    }
    fields.update(LOOKUP_CASES[case])
    error = base.stack.error("lookup", gateway_pb2.LookupRequest(**fields))
    assert code_of(error) == "INVALID_ARGUMENT"
    base.assert_intact()


@pytest.mark.transports  # refused before the deadline
def test_a_lookup_wait_above_the_gateways_maximum_is_invalid(base: Baseline) -> None:
    request = gateway_pb2.LookupRequest(
        request_id="other", model_name=MODEL, world_size=1, token_ids=base.tokens,
        wait_timeout_ms=60_001,
    )  # fmt: skip
    # A long wait needs a deadline above it, or the client's own deadline answers first.
    error = base.stack.error("lookup", request, timeout=5.0)
    assert code_of(error) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_a_prompt_over_the_gateways_token_limit_is_invalid(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack(gateway={"max_tokens": 4 * CHUNK})
    stack.register(engine)
    request = gateway_pb2.LookupRequest(
        request_id="big", model_name=MODEL, world_size=1, token_ids=prompt(5)
    )
    assert code_of(stack.error("lookup", request)) == "INVALID_ARGUMENT"
    assert stack.locked() == 0


@pytest.mark.transports  # refused before the deadline
def test_a_wait_above_the_gateways_maximum_is_invalid(base: Baseline) -> None:
    request = gateway_pb2.WaitPrefetchStatusRequest(request_id="held", timeout_ms=60_001)
    error = base.stack.error("wait_prefetch_status", request, timeout=5.0)
    assert code_of(error) == "INVALID_ARGUMENT"
    base.assert_intact()


def test_a_block_allocation_without_request_id_is_invalid(base: Baseline) -> None:
    request = gateway_pb2.ReportBlockAllocationRequest(
        engine_id=base.engine.engine_id,
        model_name=MODEL,
        allocations=[gateway_pb2.BlockAllocation(request_id="a"), gateway_pb2.BlockAllocation()],
    )
    assert base.code("report_block_allocation", request) == "INVALID_ARGUMENT"
    base.assert_intact()


@pytest.mark.transports  # storage's error relayed
@pytest.mark.parametrize("method", ["commit_store", "commit_retrieve"])
def test_a_commit_of_an_unknown_transaction_is_not_found(
    make_stack: StackFactory, method: str
) -> None:
    stack = make_stack()
    stack.client.register_engine_context(
        gateway_pb2.RegisterEngineContextRequest(
            engine_id="ctx", model_name=MODEL, world_size=1,
            layout=gateway_pb2.EngineContextLayout(
                num_layers=2, block_size=16, kv_heads=2, head_dim=8, dtype=common_pb2.DTYPE_FLOAT16
            ),
        )
    )  # fmt: skip
    request_type = (
        gateway_pb2.CommitStoreRequest
        if method == "commit_store"
        else gateway_pb2.CommitRetrieveRequest
    )
    error = stack.error(method, request_type(engine_id="ctx", transaction_id="store-1-nope"))
    assert code_of(error) == "NOT_FOUND"


# -- storage down ---------------------------------------------------------------------------


@pytest.mark.transports  # storage unreachable
def test_a_gateway_whose_storage_is_not_listening_answers_unavailable(
    make_stack: StackFactory, engine: Engine
) -> None:
    stack = make_stack()
    dead = make_stack(node=stack.node, gateway={"storage_target": f"127.0.0.1:{free_port()}"})
    request = register_request(engine, engine_id=engine.engine_id)
    # Well inside the deadline: UNAVAILABLE, not DEADLINE_EXCEEDED.
    error = dead.error("register_kv_cache", request, timeout=10.0)
    assert code_of(error) == "UNAVAILABLE"
    assert not dead.client.ping(gateway_pb2.PingRequest(engine_id=engine.engine_id)).engine_known
    # The gateway itself is up: calls that need no storage are answered.
    assert dead.client.get_chunk_size(gateway_pb2.GetChunkSizeRequest()).chunk_size == CHUNK


@pytest.mark.transports  # storage unreachable
@pytest.mark.parametrize("method", ["lookup", "store", "retrieve", "end_session", "clear"])
def test_calls_that_need_a_stopped_storage_node_answer_unavailable(
    base: Baseline, thread: ServerThread, method: str
) -> None:
    stack = base.stack
    requests: dict[str, Any] = {
        "lookup": gateway_pb2.LookupRequest(
            request_id="after", model_name=MODEL, world_size=1, token_ids=base.tokens,
            wait_timeout_ms=1000,
        ),
        "store": store_request(base),
        "retrieve": retrieve_request(base),
        "end_session": gateway_pb2.EndSessionRequest(request_id="held"),
        "clear": gateway_pb2.ClearRequest(),
    }  # fmt: skip
    thread.stop(stack.node.server, grace=0)
    # Hold the stopped node's port (bound, not listening: connections are refused), so
    # a server another test starts meanwhile cannot take it and answer in its place
    # (a loaded CI run once saw the clear succeed that way).
    host, _, port = stack.node.server.target.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        holder.bind((host, int(port)))
        error = stack.error(method, requests[method], timeout=10.0)
    assert code_of(error) == "UNAVAILABLE"
    # The engine's memory was not touched.
    assert np.array_equal(np.asarray(base.engine.kv), base.before)


def _unused(_: grpc.StatusCode) -> None:
    """Keep the grpc import for the type annotations of helpers above."""
