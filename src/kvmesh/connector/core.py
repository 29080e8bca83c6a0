"""``KVMeshConnector``: vLLM's KV-connector hooks over kvmesh's gateway.

vLLM builds one connector per role: the **scheduler** side decides, per
request, how many prompt tokens kvmesh can supply and what to load and save
in each step; the **worker** side registers the paged KV memory and executes
those loads and saves. This class has the same hooks under the same names,
taking plain objects (:mod:`kvmesh.connector.metadata`), so wiring it into vLLM is an
adapter that copies fields, not a rewrite. The flow follows LMCache's MP
connector (reference §6.3, §6.4):

scheduler, per request:
  1. :meth:`get_num_new_matched_tokens` — sends ``Lookup`` once (it returns at
     once; L2 hits keep loading in the background), then polls
     ``QueryPrefetchStatus``; ``None`` means "ask again next step". A gateway
     error, or a lookup still unfinished after ``lookup_timeout_s``, gives 0:
     the engine recomputes, it never waits on kvmesh.
  2. :meth:`update_state_after_alloc` — frees the lookup locks of the chunks
     that will not be retrieved.
  3. :meth:`build_connector_meta` — a retrieve op (``start`` rounded down to a
     chunk, ``skip_first_n_tokens`` = the engine's own prefix hit inside it)
     and store ops for newly computed complete chunks.
  4. :meth:`request_finished` — ``EndSession`` (releases whatever locks remain).

worker, per step: :meth:`start_load_kv` → :meth:`wait_for_load` → forward →
:meth:`save_kv` → :meth:`wait_for_save`. A failed or short retrieve is
reported (request ids, and block ids via :meth:`get_block_ids_with_load_errors`)
so the engine recomputes from the first missing block. If the gateway
forgot the engine (it restarted), the worker registers again and retries once.

Every call has a deadline (the typed client's defaults, or ``rpc_timeout_s``).

A vLLM ``KVConnectorBase_V1`` adapter maps: ``request_finished(request,
block_ids)`` → ``(request_finished(request), None)``; ``start_load_kv(ctx)`` →
``start_load_kv(bound metadata)`` and ``wait_for_layer_load`` → one
:meth:`wait_for_load` before the first layer; ``save_kv_layer`` → nothing,
``wait_for_save()`` → :meth:`save_kv` + :meth:`wait_for_save`;
``register_kv_caches(kv_caches)`` → the same, plus the shared-memory regions
of the engine's KV allocator.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.common.dtypes import proto_of_torch
from kvmesh.connector.metadata import (
    ConnectorMetadata,
    Request,
    RetrieveOp,
    SchedulerOutput,
    StoreOp,
)
from kvmesh.gateway.client import GatewayClient

if TYPE_CHECKING:  # the engine hands tensors in; importing the connector loads no torch
    import torch

logger = logging.getLogger(__name__)

_Resp = TypeVar("_Resp")


class KVConnectorRole(enum.Enum):
    """Which half of the connector an instance is (vLLM's ``KVConnectorRole``)."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


class ConnectorError(RuntimeError):
    """The connector cannot do what was asked (bad KV tensors, registration refused)."""


class ShmRegion(Protocol):
    """Where one layer's KV tensor lives in a shared-memory file."""

    @property
    def path(self) -> str:
        """Absolute path of the file."""
        ...

    @property
    def offset_bytes(self) -> int:
        """Start of the layer in the file."""
        ...

    @property
    def size_bytes(self) -> int:
        """Bytes of the layer."""
        ...


@dataclass(frozen=True)
class KVMeshConnectorConfig:
    """Settings of the connector (vLLM: ``kv_connector_extra_config``)."""

    #: Gateway address, ``host:port`` or ``unix:path``.
    gateway: str
    #: vLLM's ``model_config.model``: part of every cache key.
    model_name: str
    #: Tokens per paged block of the engine.
    block_size: int = 16
    world_size: int = 1
    worker_id: int = 0
    #: Unique per worker process; generated when empty.
    engine_id: str = ""
    num_kv_readers: int = 1
    #: A lookup unfinished after this long counts as a miss (LMCache: mq_timeout).
    lookup_timeout_s: float = 30.0
    #: Deadline of each RPC; None keeps the typed client's per-RPC defaults.
    rpc_timeout_s: float | None = None
    #: Threads that run the worker's retrieves and stores.
    transfer_threads: int = 2


@dataclass(frozen=True)
class LookupResult:
    """A finished lookup: cached tokens, and the chunks found in L1 / loaded from L2."""

    hit_tokens: int
    l1_hit_chunks: int
    l2_hit_chunks: int


@dataclass
class _RequestState:
    """Scheduler-side bookkeeping of one request."""

    request: Request
    lookup_deadline: float
    lookup_sent: bool = False
    #: Chunk-aligned tokens kvmesh holds (None until the lookup finished).
    hit_tokens: int | None = None
    l1_hit_chunks: int = 0
    l2_hit_chunks: int = 0
    #: The engine's own prefix-cache hit when matched (vLLM: num_computed_tokens).
    local_hit_tokens: int = 0
    num_external_tokens: int = 0
    load_pending: bool = False
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    stored_tokens: int = 0
    stores_emitted: bool = False


@dataclass
class _Transfer:
    """One retrieve or store the worker started."""

    request_id: str
    future: Future[list[int]]


def _status_code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    """The status code of a failed call (None for an error raised outside a call)."""
    code = getattr(exc, "code", None)
    return code() if callable(code) else None


def _rpc_failure(exc: grpc.RpcError) -> str:
    code = _status_code(exc)
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return f"{code.name if code else 'ERROR'}: {text}"


class KVMeshConnector:
    """The KV-connector hooks of one role, talking to one gateway over gRPC."""

    def __init__(
        self,
        config: KVMeshConnectorConfig,
        role: KVConnectorRole,
        *,
        client: GatewayClient | None = None,
    ) -> None:
        if config.block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.config = config
        self.role = role
        self.engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:16]}"
        self._owns_client = client is None
        self.client = client or GatewayClient(config.gateway)
        self._timeout = config.rpc_timeout_s
        self._chunk_size: int | None = None
        # Scheduler side.
        self._requests: dict[str, _RequestState] = {}
        # Worker side.
        self._registration: gateway_pb2.RegisterKVCacheRequest | None = None
        self._register_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._loads: list[_Transfer] = []
        self._saves: list[_Transfer] = []
        self._load_error_blocks: set[int] = set()

    # ------------------------------------------------------------------ common

    def _require(self, role: KVConnectorRole) -> None:
        if self.role is not role:
            raise RuntimeError(f"{role.value}-side hook called on a {self.role.value} connector")

    @property
    def chunk_size(self) -> int:
        """The gateway's chunk size (asked once; raises ``grpc.RpcError`` if unreachable)."""
        if self._chunk_size is None:
            resp = self.client.get_chunk_size(
                gateway_pb2.GetChunkSizeRequest(), timeout=self._timeout
            )
            self._check_chunk_size(resp.chunk_size)
        assert self._chunk_size is not None
        return self._chunk_size

    def _check_chunk_size(self, chunk_size: int) -> None:
        if chunk_size < 1 or chunk_size % self.config.block_size:
            raise ConnectorError(
                f"the gateway's chunk size {chunk_size} is not a multiple of the engine's "
                f"block size {self.config.block_size}"
            )
        self._chunk_size = chunk_size

    def ping(self) -> bool:
        """Liveness of the gateway (the worker also refreshes its engine's last-seen time)."""
        engine_id = self.engine_id if self.role is KVConnectorRole.WORKER else ""
        try:
            self.client.ping(gateway_pb2.PingRequest(engine_id=engine_id), timeout=self._timeout)
        except grpc.RpcError as exc:
            logger.warning("gateway %s: ping failed: %s", self.config.gateway, _rpc_failure(exc))
            return False
        return True

    def shutdown(self) -> None:
        """Finish transfers, unregister the KV memory (worker) and close the channel."""
        if self.role is KVConnectorRole.WORKER:
            self.wait_for_load()
            self.wait_for_save()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._registration is not None:
                try:
                    self.client.unregister_kv_cache(
                        gateway_pb2.UnregisterKVCacheRequest(engine_id=self.engine_id),
                        timeout=self._timeout,
                    )
                except grpc.RpcError as exc:
                    logger.warning("unregistering %s failed: %s", self.engine_id, _rpc_failure(exc))
                self._registration = None
        else:
            for request_id in list(self._requests):
                self._end_session(request_id)
            self._requests.clear()
        if self._owns_client:
            self.client.close()

    # --------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvmesh will load, and whether async.

        Returns ``(None, False)`` while the lookup is still running (ask again
        later), and ``(0, False)`` when kvmesh cannot help (miss, error,
        timeout). Never blocks beyond one short RPC.
        """
        self._require(KVConnectorRole.SCHEDULER)
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(
                request, lookup_deadline=time.monotonic() + self.config.lookup_timeout_s
            )
            self._requests[request.request_id] = state
        if state.hit_tokens is None:
            state.hit_tokens = self._poll_lookup(state)
            if state.hit_tokens is None:
                return None, False
        n = request.num_prompt_tokens
        # The last prompt token is always recomputed (its logits are needed), and a
        # load ends on a block boundary (vLLM only counts whole blocks as computed).
        usable = min(state.hit_tokens, n - 1) if n else 0
        usable -= usable % self.config.block_size
        need = max(0, usable - num_computed_tokens)
        state.local_hit_tokens = num_computed_tokens
        state.num_external_tokens = need
        return need, need > 0

    def lookup_result(self, request_id: str) -> LookupResult:
        """What kvmesh reported for a request's lookup (zeros until it finished)."""
        state = self._requests.get(request_id)
        if state is None:
            return LookupResult(0, 0, 0)
        return LookupResult(state.hit_tokens or 0, state.l1_hit_chunks, state.l2_hit_chunks)

    def _poll_lookup(self, state: _RequestState) -> int | None:
        """Send the lookup or poll it: hit tokens, or None while it runs."""
        request = state.request
        try:
            chunk = self.chunk_size
            if request.num_prompt_tokens < chunk:
                return 0  # no complete chunk: nothing to look up
            if not state.lookup_sent:
                resp = self.client.lookup(
                    gateway_pb2.LookupRequest(
                        request_id=request.request_id,
                        model_name=self.config.model_name,
                        world_size=self.config.world_size,
                        cache_salt=request.cache_salt,
                        token_ids=request.prompt_token_ids,
                        num_kv_readers=self.config.num_kv_readers,
                    ),
                    timeout=self._timeout,
                )
                state.lookup_sent = True
                status = resp.status
            else:
                status = self.client.query_prefetch_status(
                    gateway_pb2.QueryPrefetchStatusRequest(request_id=request.request_id),
                    timeout=self._timeout,
                ).status
        except (grpc.RpcError, ConnectorError) as exc:
            detail = _rpc_failure(exc) if isinstance(exc, grpc.RpcError) else str(exc)
            logger.warning("lookup of %s failed, recomputing it: %s", request.request_id, detail)
            return 0
        if status.completed:
            logger.debug(
                "lookup %s: %d of %d tokens cached (L1 %d, L2 %d chunks)",
                request.request_id,
                status.hit_tokens,
                request.num_prompt_tokens,
                status.l1_hit_chunks,
                status.l2_hit_chunks,
            )
            state.l1_hit_chunks = status.l1_hit_chunks
            state.l2_hit_chunks = status.l2_hit_chunks
            return int(status.hit_tokens)
        if time.monotonic() > state.lookup_deadline:
            logger.warning(
                "lookup of %s unfinished after %.1f s, recomputing it",
                request.request_id,
                self.config.lookup_timeout_s,
            )
            return 0
        return None

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Record the request's blocks; free the lookup locks of chunks not retrieved."""
        self._require(KVConnectorRole.SCHEDULER)
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(request, lookup_deadline=0.0, hit_tokens=0)
            self._requests[request.request_id] = state
        state.block_ids = list(block_ids)
        state.num_external_tokens = num_external_tokens
        hit = state.hit_tokens or 0
        state.stored_tokens = hit  # what kvmesh holds is never stored again
        state.num_computed_tokens = state.local_hit_tokens + num_external_tokens
        if num_external_tokens > 0:
            state.load_pending = True
            # Chunks wholly inside the engine's own prefix hit are not retrieved.
            free_end = (state.local_hit_tokens // self.chunk_size) * self.chunk_size
        else:
            free_end = hit
        if state.lookup_sent and free_end > 0:
            try:
                self.client.free_lookup_locks(
                    gateway_pb2.FreeLookupLocksRequest(
                        request_id=request.request_id, start_token=0, end_token=free_end
                    ),
                    timeout=self._timeout,
                )
            except grpc.RpcError as exc:
                # Harmless: EndSession (or the session's expiry) releases them.
                logger.warning(
                    "freeing lookup locks of %s failed: %s", request.request_id, _rpc_failure(exc)
                )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """The retrieves and stores the workers run in this step."""
        self._require(KVConnectorRole.SCHEDULER)
        meta = ConnectorMetadata()
        bs = self.config.block_size
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(request_id)
            if state is None:
                continue
            request = state.request
            if state.load_pending:
                state.load_pending = False
                chunk = self.chunk_size
                start = (state.local_hit_tokens // chunk) * chunk
                end = state.hit_tokens or 0
                meta.retrieve_ops.append(
                    RetrieveOp(
                        request_id=request_id,
                        token_ids=request.prompt_token_ids[:end],
                        cache_salt=request.cache_salt,
                        start=start,
                        end=end,
                        skip_first_n_tokens=state.local_hit_tokens - start,
                        block_ids=state.block_ids[start // bs : end // bs],
                    )
                )
            state.num_computed_tokens += scheduled
            limit = min(
                request.num_prompt_tokens,  # only prompt chunks (save_decode_cache = false)
                len(state.block_ids) * bs,
                state.num_computed_tokens,
            )
            try:
                end = (limit // self.chunk_size) * self.chunk_size
            except (grpc.RpcError, ConnectorError) as exc:
                logger.warning("cannot plan stores of %s: %s", request_id, exc)
                continue
            if end > state.stored_tokens:
                start = state.stored_tokens
                meta.store_ops.append(
                    StoreOp(
                        request_id=request_id,
                        token_ids=request.prompt_token_ids[:end],
                        cache_salt=request.cache_salt,
                        start=start,
                        end=end,
                        block_ids=state.block_ids[start // bs : end // bs],
                    )
                )
                state.stored_tokens = end
                state.stores_emitted = True
        return meta

    def request_finished(self, request: Request) -> bool:
        """End the request's session; True when its blocks must wait for a store to finish."""
        self._require(KVConnectorRole.SCHEDULER)
        state = self._requests.pop(request.request_id, None)
        self._end_session(request.request_id)
        return state is not None and state.stores_emitted

    def _end_session(self, request_id: str) -> None:
        try:
            self.client.end_session(
                gateway_pb2.EndSessionRequest(request_id=request_id), timeout=self._timeout
            )
        except grpc.RpcError as exc:
            # The gateway's session expiry releases whatever is left.
            logger.warning("ending session %s failed: %s", request_id, _rpc_failure(exc))

    # ------------------------------------------------------------------ worker

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], regions: Mapping[str, ShmRegion]
    ) -> None:
        """Register the paged KV tensors (flash-attn layout, layer order) and their memory.

        ``regions[name]`` says where ``kv_caches[name]`` lives in shared memory;
        storage maps it and copies blocks directly. Raises
        :class:`ConnectorError` on unusable tensors and ``grpc.RpcError`` when
        the gateway refuses.
        """
        self._require(KVConnectorRole.WORKER)
        if not kv_caches:
            raise ConnectorError("no KV caches to register")
        if set(kv_caches) != set(regions):
            raise ConnectorError("kv_caches and regions name different layers")
        tensors = list(kv_caches.values())
        first = tensors[0]
        shape = tuple(first.shape)
        if len(shape) != 5 or shape[0] != 2:
            raise ConnectorError(
                f"expected flash-attn layers [2, num_blocks, block_size, kv_heads, head_dim], "
                f"got {shape}"
            )
        if shape[2] != self.config.block_size:
            raise ConnectorError(
                f"layers have block size {shape[2]}, configured {self.config.block_size}"
            )
        dtype = proto_of_torch(first.dtype)
        if dtype is None:
            raise ConnectorError(f"unsupported KV dtype {first.dtype}")
        handles = []
        for name, tensor in kv_caches.items():
            if tuple(tensor.shape) != shape or tensor.dtype != first.dtype:
                raise ConnectorError(f"layer {name} differs in shape or dtype from the first")
            if not tensor.is_contiguous():
                raise ConnectorError(f"layer {name} is not contiguous")
            region = regions[name]
            nbytes = tensor.numel() * tensor.element_size()
            if region.size_bytes != nbytes:
                raise ConnectorError(
                    f"layer {name}: region of {region.size_bytes} bytes for a {nbytes}-byte tensor"
                )
            handles.append(
                common_pb2.MemoryHandle(
                    shared_memory=common_pb2.SharedMemoryHandle(
                        path=region.path,
                        offset_bytes=region.offset_bytes,
                        size_bytes=region.size_bytes,
                    )
                )
            )
        request = gateway_pb2.RegisterKVCacheRequest(
            engine_id=self.engine_id,
            model_name=self.config.model_name,
            world_size=self.config.world_size,
            worker_id=self.config.worker_id,
            layout=common_pb2.KVLayout(
                kind=common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
                num_layers=len(tensors),
                num_blocks=shape[1],
                block_size=shape[2],
                kv_heads=shape[3],
                head_dim=shape[4],
                dtype=dtype,  # type: ignore[arg-type]
            ),
            layers=handles,
        )
        self._registration = request
        self._register()

    def _register(self) -> None:
        assert self._registration is not None
        with self._register_lock:
            resp = self.client.register_kv_cache(self._registration, timeout=self._timeout)
        self._check_chunk_size(resp.chunk_size)
        logger.info(
            "engine %s registered with gateway %s (chunk size %d, storage %s)",
            self.engine_id,
            self.config.gateway,
            resp.chunk_size,
            resp.storage_instance_id or "?",
        )

    def _prompt_range(self, op: RetrieveOp | StoreOp) -> gateway_pb2.PromptRange:
        return gateway_pb2.PromptRange(
            request_id=op.request_id,
            model_name=self.config.model_name,
            world_size=self.config.world_size,
            cache_salt=op.cache_salt,
            token_ids=op.token_ids,
            start_token=op.start,
            end_token=op.end,
        )

    def _with_reregister(self, call: str, fn: Callable[[], _Resp]) -> _Resp:
        """Run ``fn``; if the gateway forgot this engine (it restarted), register and retry once."""
        try:
            return fn()
        except grpc.RpcError as exc:
            if (
                _status_code(exc) != grpc.StatusCode.FAILED_PRECONDITION
                or self._registration is None
            ):
                raise
            logger.warning(
                "%s: gateway does not know engine %s; registering again", call, self.engine_id
            )
            self._register()
            return fn()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.config.transfer_threads, thread_name_prefix="kvmesh-transfer"
            )
        return self._pool

    def _retrieve(self, op: RetrieveOp) -> list[int]:
        """Run one retrieve; the block ids it could not fill (empty on success)."""
        skip_blocks = op.skip_first_n_tokens // self.config.block_size
        if self._registration is None:
            logger.warning("retrieve of %s before register_kv_caches", op.request_id)
            return list(op.block_ids[skip_blocks:])
        request = gateway_pb2.RetrieveRequest(
            engine_id=self.engine_id,
            range=self._prompt_range(op),
            block_ids=op.block_ids,
            skip_first_n_tokens=op.skip_first_n_tokens,
        )
        try:
            resp = self._with_reregister(
                "retrieve", lambda: self.client.retrieve(request, timeout=self._timeout)
            )
        except grpc.RpcError as exc:
            logger.warning("retrieve of %s failed: %s", op.request_id, _rpc_failure(exc))
            return list(op.block_ids[skip_blocks:])
        loaded = resp.retrieved_chunks * self.chunk_size
        if op.start + loaded >= op.end:
            return []
        first_missing = max(loaded // self.config.block_size, skip_blocks)
        logger.warning(
            "retrieve of %s got %d of %d tokens", op.request_id, loaded, op.end - op.start
        )
        return list(op.block_ids[first_missing:])

    def _store(self, op: StoreOp) -> list[int]:
        """Run one store; [] on success, else the op's block ids."""
        if self._registration is None:
            logger.warning("store of %s before register_kv_caches", op.request_id)
            return list(op.block_ids)
        request = gateway_pb2.StoreRequest(
            engine_id=self.engine_id, range=self._prompt_range(op), block_ids=op.block_ids
        )
        try:
            resp = self._with_reregister(
                "store", lambda: self.client.store(request, timeout=self._timeout)
            )
        except grpc.RpcError as exc:
            logger.warning("store of %s failed: %s", op.request_id, _rpc_failure(exc))
            return list(op.block_ids)
        if resp.skipped_chunks:
            logger.info(
                "store of %s: %d chunks did not fit in L1", op.request_id, resp.skipped_chunks
            )
        return []

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Start the step's retrieves (before the forward pass)."""
        self._require(KVConnectorRole.WORKER)
        for op in metadata.retrieve_ops:
            self._loads.append(
                _Transfer(op.request_id, self._executor().submit(self._retrieve, op))
            )

    def wait_for_load(self) -> set[str]:
        """Wait for the started retrieves; the ids of requests whose load fell short."""
        failed: set[str] = set()
        for transfer in self._loads:
            missing = transfer.future.result()
            if missing:
                failed.add(transfer.request_id)
                self._load_error_blocks.update(missing)
        self._loads = []
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that retrieves failed to fill since the last call (the engine recomputes them)."""
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def save_kv(self, metadata: ConnectorMetadata) -> None:
        """Start the step's stores (after the forward pass wrote the KV)."""
        self._require(KVConnectorRole.WORKER)
        for op in metadata.store_ops:
            self._saves.append(_Transfer(op.request_id, self._executor().submit(self._store, op)))

    def wait_for_save(self) -> set[str]:
        """Wait for the started stores; the ids of requests whose store failed."""
        failed = {t.request_id for t in self._saves if t.future.result()}
        self._saves = []
        return failed
