"""An in-process stand-in for the gateway + storage, for connector and engine unit tests.

It answers the GatewayClient methods the connector calls. Like a storage
node it maps the engine's shared-memory KV file from the registered handles
(so wrong offsets or sizes would copy the wrong bytes) and keeps chunks keyed
by (model, salt, every token up to the chunk's end) — the identity that
kvmesh's chained chunk hashes give. Failure knobs let tests break it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kvmesh.api.gateway.v1 import gateway_pb2


class FakeRpcError(grpc.RpcError):
    """A failed call with a status code, as grpc raises it."""

    def __init__(self, code: grpc.StatusCode, details: str = "fake failure") -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass
class FakeGateway:
    """Gateway semantics over an in-memory chunk store; records every call."""

    chunk_size: int = 256
    #: QueryPrefetchStatus calls answered "not completed" before the lookup completes
    #: (the Lookup itself answers "not completed" whenever this is > 0).
    pending_polls: int = 0
    #: Method names that raise UNAVAILABLE.
    failing: set[str] = field(default_factory=set)
    #: Retrieve copies at most this many chunks (None: all it has).
    retrieve_limit: int | None = None
    #: Store/Retrieve answer FAILED_PRECONDITION this many times (a restarted gateway).
    forget_engine: int = 0
    #: Retrieve calls (counted from 0) that raise UNAVAILABLE.
    failing_retrieves: set[int] = field(default_factory=set)
    #: While not set, a Retrieve of a layer range that does not start at layer 0 waits.
    later_parts_gate: threading.Event | None = None
    #: While not set, an EndSession waits (before it is recorded).
    end_session_gate: threading.Event | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    #: The deadline (``timeout``) each RegisterKVCache, Store and Retrieve was sent with.
    deadlines: list[tuple[str, float | None]] = field(default_factory=list)
    chunks: dict[tuple[str, str, tuple[int, ...]], list[torch.Tensor]] = field(default_factory=dict)
    layers: list[torch.Tensor] = field(default_factory=list)
    registered: bool = False
    _polls: dict[str, int] = field(default_factory=dict)
    #: Each request's tokens, as the gateway's session keeps them.
    _tokens: dict[str, list[int]] = field(default_factory=dict)
    _lookups: dict[str, int] = field(default_factory=dict)

    #: What the connector asked wait_holding_gil for: rpc name -> seconds.
    held_waits: dict[str, float] = field(default_factory=dict)

    def wait_holding_gil(self, rpc: str, seconds: float) -> None:
        self.held_waits[rpc] = seconds

    def _enter(self, name: str, request: Any) -> None:
        self.calls.append((name, request))
        if name in self.failing:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, f"{name} is down")

    def names(self) -> list[str]:
        """Methods called, in order."""
        return [name for name, _ in self.calls]

    def requests(self, name: str) -> list[Any]:
        """Requests of one method, in order."""
        return [req for n, req in self.calls if n == name]

    def close(self) -> None:
        """GatewayClient.close."""

    # ------------------------------------------------------------- helpers

    def _key(self, model: str, salt: str, tokens: Sequence[int], chunk: int) -> tuple[Any, ...]:
        return (model, salt, tuple(tokens[: (chunk + 1) * self.chunk_size]))

    def _cached_prefix(self, model: str, salt: str, tokens: Sequence[int], n_chunks: int) -> int:
        hit = 0
        while hit < n_chunks and self._key(model, salt, tokens, hit) in self.chunks:
            hit += 1
        return hit

    def _blocks_of_chunk(self, block_ids: Sequence[int], i: int) -> torch.Tensor:
        bpc = self.chunk_size // self.layers[0].shape[2]
        return torch.tensor(list(block_ids[i * bpc : (i + 1) * bpc]), dtype=torch.long)

    def _check_engine(self) -> None:
        if self.forget_engine > 0:
            self.forget_engine -= 1
            self.registered = False
        if not self.registered:
            raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "engine not registered")

    # ------------------------------------------------------------- RPCs

    def get_chunk_size(self, request: Any, **_: Any) -> Any:
        self._enter("GetChunkSize", request)
        return gateway_pb2.GetChunkSizeResponse(chunk_size=self.chunk_size)

    def ping(self, request: Any, **_: Any) -> Any:
        self._enter("Ping", request)
        return gateway_pb2.PingResponse(engine_known=self.registered)

    def register_kv_cache(self, request: Any, *, timeout: float | None = None, **_: Any) -> Any:
        self._enter("RegisterKVCache", request)
        self.deadlines.append(("RegisterKVCache", timeout))
        lay = request.layout
        shape = (2, lay.num_blocks, lay.block_size, lay.kv_heads, lay.head_dim)
        numel = 2 * lay.num_blocks * lay.block_size * lay.kv_heads * lay.head_dim
        self.layers = []
        for handle in request.layers:
            shm = handle.shared_memory
            assert shm.size_bytes == numel * 4, "region size is not one layer"
            assert shm.offset_bytes % 4 == 0
            whole = torch.from_file(
                shm.path, shared=True, size=(shm.offset_bytes + shm.size_bytes) // 4
            )
            self.layers.append(whole[shm.offset_bytes // 4 :].view(shape))
        already = self.registered
        self.registered = True
        return gateway_pb2.RegisterKVCacheResponse(
            chunk_size=self.chunk_size, storage_instance_id="fake", already_registered=already
        )

    def unregister_kv_cache(self, request: Any, **_: Any) -> Any:
        self._enter("UnregisterKVCache", request)
        existed, self.registered, self.layers = self.registered, False, []
        return gateway_pb2.UnregisterKVCacheResponse(existed=existed)

    def _status(self, request_id: str) -> Any:
        hit = self._lookups[request_id]
        if self._polls.get(request_id, 0) > 0:
            return gateway_pb2.PrefetchStatus(completed=False)
        return gateway_pb2.PrefetchStatus(
            completed=True, hit_chunks=hit, hit_tokens=hit * self.chunk_size, l1_hit_chunks=hit
        )

    def lookup(self, request: Any, **_: Any) -> Any:
        self._enter("Lookup", request)
        tokens = list(request.token_ids)
        end = request.end_token or len(tokens)
        n_chunks = end // self.chunk_size
        hit = self._cached_prefix(request.model_name, request.cache_salt, tokens, n_chunks)
        self._lookups[request.request_id] = hit
        self._polls[request.request_id] = self.pending_polls
        return gateway_pb2.LookupResponse(
            status=self._status(request.request_id), requested_chunks=n_chunks
        )

    def query_prefetch_status(self, request: Any, **_: Any) -> Any:
        self._enter("QueryPrefetchStatus", request)
        if request.request_id not in self._lookups:
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND, "no lookup")
        if self._polls.get(request.request_id, 0) > 0:
            self._polls[request.request_id] -= 1
            return gateway_pb2.QueryPrefetchStatusResponse(
                status=gateway_pb2.PrefetchStatus(completed=False)
            )
        return gateway_pb2.QueryPrefetchStatusResponse(status=self._status(request.request_id))

    def free_lookup_locks(self, request: Any, **_: Any) -> Any:
        self._enter("FreeLookupLocks", request)
        return gateway_pb2.FreeLookupLocksResponse()

    def end_session(self, request: Any, **_: Any) -> Any:
        if self.end_session_gate is not None:
            self.end_session_gate.wait(30)
        self._enter("EndSession", request)
        existed = self._lookups.pop(request.request_id, None) is not None
        return gateway_pb2.EndSessionResponse(existed=existed)

    def store(self, request: Any, *, timeout: float | None = None, **_: Any) -> Any:
        self._enter("Store", request)
        self.deadlines.append(("Store", timeout))
        self._check_engine()
        rng = request.range
        tokens = list(rng.token_ids)
        first, last = rng.start_token // self.chunk_size, rng.end_token // self.chunk_size
        stored = cached = 0
        for i, chunk in enumerate(range(first, last)):
            key = self._key(rng.model_name, rng.cache_salt, tokens, chunk)
            if key in self.chunks:
                cached += 1
                continue
            blocks = self._blocks_of_chunk(request.block_ids, i)
            self.chunks[key] = [layer.index_select(1, blocks).clone() for layer in self.layers]
            stored += 1
        return gateway_pb2.StoreResponse(stored_chunks=stored, already_cached_chunks=cached)

    def retrieve(self, request: Any, *, timeout: float | None = None, **_: Any) -> Any:
        self._enter("Retrieve", request)
        self.deadlines.append(("Retrieve", timeout))
        if len(self.requests("Retrieve")) - 1 in self.failing_retrieves:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "this Retrieve fails")
        self._check_engine()
        rng = request.range
        tokens = list(rng.token_ids) or self._tokens.get(rng.request_id, [])
        self._tokens[rng.request_id] = tokens
        start, end = (
            (request.layers.start, request.layers.end)
            if request.HasField("layers")
            else (0, len(self.layers))
        )
        if start > 0 and self.later_parts_gate is not None:
            self.later_parts_gate.wait(10)
        first, last = rng.start_token // self.chunk_size, rng.end_token // self.chunk_size
        skip_blocks = request.skip_first_n_tokens // self.layers[0].shape[2]
        done = 0
        for i, chunk in enumerate(range(first, last)):
            key = self._key(rng.model_name, rng.cache_salt, tokens, chunk)
            if key not in self.chunks or (
                self.retrieve_limit is not None and done >= self.retrieve_limit
            ):
                break
            blocks = self._blocks_of_chunk(request.block_ids, i)
            bpc = blocks.numel()
            keep = slice(max(0, skip_blocks - i * bpc), bpc)
            for layer, saved in list(zip(self.layers, self.chunks[key], strict=True))[start:end]:
                layer.index_copy_(1, blocks[keep], saved[:, keep])
            done += 1
        return gateway_pb2.RetrieveResponse(
            retrieved_chunks=done, retrieved_tokens=done * self.chunk_size
        )
