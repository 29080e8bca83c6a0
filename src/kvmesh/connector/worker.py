"""Worker half of the connector: KV registration, retrieves and stores.

See docs/connector.md, "Worker flow".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.common.dtypes import proto_of_torch
from kvmesh.connector.base import ConnectorBase
from kvmesh.connector.heartbeat import Heartbeat
from kvmesh.connector.layered import LayeredLoad, layer_groups
from kvmesh.connector.metadata import ConnectorMetadata, RetrieveOp, StoreOp
from kvmesh.connector.types import (
    ConnectorError,
    KVConnectorRole,
    KVMeshConnectorConfig,
    ShmRegion,
    rpc_failure,
    status_code,
)
from kvmesh.gateway.client import GatewayClient

if TYPE_CHECKING:  # the engine hands tensors in; importing the connector loads no torch
    import torch

logger = logging.getLogger(__name__)

_Resp = TypeVar("_Resp")
_Result = TypeVar("_Result")


def _run_now(fn: Callable[..., _Result], *args: object) -> Future[_Result]:
    """``fn(*args)`` run on this thread, as a finished future (its result or its exception)."""
    future: Future[_Result] = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)
    return future


@dataclass
class _Transfer:
    """One retrieve or store the worker started."""

    request_id: str
    future: Future[list[int]]


class WorkerHooks(ConnectorBase):
    """The worker-side hooks (one instance per engine worker process)."""

    def __init__(
        self,
        config: KVMeshConnectorConfig,
        role: KVConnectorRole,
        *,
        client: GatewayClient | None = None,
    ) -> None:
        super().__init__(config, role, client=client)
        self._registration: gateway_pb2.RegisterKVCacheRequest | None = None
        self._register_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._loads: list[_Transfer] = []
        self._load_ops: list[RetrieveOp] = []
        self._layered: list[LayeredLoad] = []
        self._saves: list[_Transfer] = []
        self._load_error_blocks: set[int] = set()
        self._load_failed: set[str] = set()  # last loads fell short: not stored (save_kv)
        self._registered = False
        #: Successful registrations (1 + re-registrations after the gateway forgot us).
        self.registrations = 0

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
        layout = common_pb2.KVLayout(
            kind=common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
            num_layers=len(tensors),
            num_blocks=shape[1],
            block_size=shape[2],
            kv_heads=shape[3],
            head_dim=shape[4],
            dtype=dtype,  # type: ignore[arg-type]
        )
        self.register_memory(layout, handles)

    def register_memory(
        self, layout: common_pb2.KVLayout, handles: Sequence[common_pb2.MemoryHandle]
    ) -> None:
        """Register KV memory the caller already described (one handle per layer, in order).

        Raises ``grpc.RpcError`` when the gateway refuses (its message names the
        field) or cannot be reached. Either way the heartbeat (``heartbeat_s``)
        keeps trying: it registers again whenever the gateway does not know the
        engine (it was down at start, restarted, or reaped the engine).
        """
        self._require(KVConnectorRole.WORKER)
        self._registration = gateway_pb2.RegisterKVCacheRequest(
            engine_id=self.engine_id,
            model_name=self.config.model_name,
            world_size=self.config.world_size,
            worker_id=self.config.worker_id,
            layout=layout,
            layers=handles,
        )
        try:
            self._register()
        finally:
            self._start_heartbeat()

    @property
    def registered(self) -> bool:
        """True while the gateway holds this engine's registration (loads and stores run)."""
        return self._registered

    def _start_heartbeat(self) -> None:
        if self._heartbeat is None and self.config.heartbeat_s > 0:
            self._heartbeat = Heartbeat(
                self._beat, self.config.heartbeat_s, f"kvmesh-heartbeat-{self.engine_id}"
            )
            self._heartbeat.start()

    def _register(self) -> None:
        assert self._registration is not None
        with self._register_lock:
            resp = self.client.register_kv_cache(
                self._registration, timeout=self.config.register_timeout_s
            )
            self._check_chunk_size(resp.chunk_size)
            first = self.registrations == 0
            self.registrations += 1
            self._registered = True
        (logger.info if first else logger.warning)(
            "engine %s %s with gateway %s (chunk size %d, storage %s)",
            self.engine_id,
            "registered" if first else "registered again",
            self.config.gateway,
            resp.chunk_size,
            resp.storage_instance_id or "?",
        )

    def _beat(self) -> None:
        """One heartbeat: ping, and register when the gateway does not know the engine."""
        if self._registration is None:
            return
        if self._registered:
            try:
                known = self.client.ping(
                    gateway_pb2.PingRequest(engine_id=self.engine_id), timeout=self._timeout
                ).engine_known
            except grpc.RpcError as exc:
                self._note_failure("heartbeat", exc)
                return
            self._note_ok()
            if known:
                return
            self._registered = False
            logger.warning(
                "kvmesh gateway %s no longer knows engine %s (restarted, or reaped it); "
                "registering again, requests are computed meanwhile",
                self.config.gateway,
                self.engine_id,
            )
        try:
            self._register()
        except grpc.RpcError as exc:
            self._note_failure("registering the KV memory", exc)
        except ConnectorError as exc:
            logger.warning("registering the KV memory failed: %s", exc)

    def _forgotten(self, call: str, exc: grpc.RpcError) -> bool:
        """True (and the heartbeat registers again, off this thread) when a call failed
        because the gateway no longer knows this engine."""
        if status_code(exc) != grpc.StatusCode.FAILED_PRECONDITION:
            return False
        if self._registered:
            self._registered = False
            logger.warning(
                "%s: gateway %s does not know engine %s; registering it again in the background",
                call,
                self.config.gateway,
                self.engine_id,
            )
        if self._heartbeat is not None:
            self._heartbeat.wake()
        return True

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.config.transfer_threads, thread_name_prefix="kvmesh-transfer"
            )
        return self._pool

    def _retrieve(self, op: RetrieveOp, producer_event: bytes = b"") -> list[int]:
        """Run one retrieve; the block ids it could not fill (empty on success)."""
        return self._missing(op, self._send_retrieve(op, producer_event))

    def _retrieve_by_layer(
        self, op: RetrieveOp, producer_event: bytes, parts: LayeredLoad
    ) -> list[int]:
        """Run one retrieve as parts by layers, in order (see :mod:`.layered`); the block
        ids some part could not fill. A failed part ends the load: the rest are not sent."""
        fewest: int | None = None
        began = time.perf_counter()
        done_at: list[float] = []
        try:
            for i, layers in enumerate(parts.groups):
                got = self._send_retrieve(op, producer_event, layers, with_tokens=i == 0)
                if got is None:
                    fewest = None
                    break
                fewest = got if fewest is None else min(fewest, got)
                parts.part_done(i)
                done_at.append((time.perf_counter() - began) * 1e3)
        finally:
            parts.finish()
        logger.debug(
            "retrieve of %s by layers: parts done at %s ms",
            op.request_id,
            ", ".join(f"{t:.1f}" for t in done_at),
        )
        return self._missing(op, fewest)

    def _send_retrieve(
        self,
        op: RetrieveOp,
        producer_event: bytes,
        layers: tuple[int, int] | None = None,
        *,
        with_tokens: bool = True,
    ) -> int | None:
        """One Retrieve call; the chunks it copied, None when it failed."""
        if not self._registered:
            logger.debug("retrieve of %s while the engine is not registered", op.request_id)
            return None
        request = self._retrieve_request(
            self.engine_id, op, producer_event=producer_event, with_tokens=with_tokens
        )
        if layers is not None:
            request.layers.start, request.layers.end = layers
        try:
            resp = self.client.retrieve(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            if not self._forgotten("retrieve", exc):
                logger.warning("retrieve of %s failed: %s", op.request_id, rpc_failure(exc))
            return None
        return int(resp.retrieved_chunks)

    def _missing(self, op: RetrieveOp, chunks: int | None) -> list[int]:
        """The op's block ids that ``chunks`` retrieved chunks leave unfilled (all: None)."""
        skip_blocks = op.skip_first_n_tokens // self.config.block_size
        if chunks is None:
            return list(op.block_ids[skip_blocks:])
        loaded = chunks * self.chunk_size
        if op.start + loaded >= op.end:
            return []
        first_missing = max(loaded // self.config.block_size, skip_blocks)
        logger.warning(
            "retrieve of %s got %d of %d tokens", op.request_id, loaded, op.end - op.start
        )
        return list(op.block_ids[first_missing:])

    def _store(self, op: StoreOp, producer_event: bytes = b"") -> list[int]:
        """Run one store; [] on success, else the op's block ids."""
        if not self._registered:
            logger.debug("store of %s while the engine is not registered", op.request_id)
            return list(op.block_ids)
        if self.gateway_down():
            return list(op.block_ids)
        request = gateway_pb2.StoreRequest(
            engine_id=self.engine_id,
            range=self._prompt_range(op),
            block_ids=op.block_ids,
            producer_event_handle=producer_event,
        )
        try:
            resp = self.client.store(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            if not self._forgotten("store", exc):
                self._note_failure(f"store of {op.request_id}", exc)
            return list(op.block_ids)
        self._note_ok()
        if resp.skipped_chunks:
            logger.info(
                "store of %s: %d chunks did not fit in L1", op.request_id, resp.skipped_chunks
            )
        return []

    def start_load_kv(
        self, metadata: ConnectorMetadata, producer_event: bytes = b"", *, by_layer: bool = False
    ) -> None:
        """Start the step's retrieves (before the forward pass).

        Each runs on a transfer thread, except the first of whole loads, which
        runs on the calling thread (beside the others) before this returns.

        ``producer_event`` (GPU): IPC handle of a CUDA event recorded on the
        engine's stream; storage's copies into the blocks wait for it.
        ``by_layer``: send each retrieve in parts by layers (:mod:`.layered`);
        the engine then calls :meth:`wait_for_layer` before each layer reads
        its KV, and :meth:`wait_for_load` before it reports the step.
        """
        self._require(KVConnectorRole.WORKER)
        self._load_failed = set()
        groups = self._layer_groups() if by_layer else None
        ops = list(metadata.retrieve_ops)
        # Every caller waits for whole loads next, so the first runs here, beside the others
        # on transfer threads: a hand-off to a thread and back cost milliseconds beside a
        # busy engine (docs/performance.md, "A step's only load").
        here = ops[0] if groups is None and ops else None
        for op in ops:
            if op is here:
                continue
            if groups is None:
                future = self._executor().submit(self._retrieve, op, producer_event)
            else:
                parts = LayeredLoad(groups)
                self._layered.append(parts)
                future = self._executor().submit(self._retrieve_by_layer, op, producer_event, parts)
            self._loads.append(_Transfer(op.request_id, future))
            self._load_ops.append(op)
        if here is not None:
            self._loads.append(
                _Transfer(here.request_id, _run_now(self._retrieve, here, producer_event))
            )
            self._load_ops.append(here)

    def _layer_groups(self) -> list[tuple[int, int]] | None:
        """The parts of a load by layers for the registered layout (None: one whole part)."""
        registration = self._registration
        if registration is None or registration.layout.num_layers < 2:
            return None
        return layer_groups(registration.layout.num_layers)

    def wait_for_layer(self, layer: int | None) -> None:
        """Block until every started load has written ``layer`` (None: every layer)."""
        for parts in self._layered:
            parts.wait_for_layer(layer)

    def wait_for_load(self) -> set[str]:
        """Wait for the started retrieves; the ids of requests whose load fell short."""
        failed: set[str] = set()
        for transfer, op in zip(self._loads, self._load_ops, strict=True):
            try:
                missing = transfer.future.result()
            except Exception:  # never into the engine: the op's blocks are recomputed
                logger.exception("retrieve of %s failed", transfer.request_id)
                missing = list(op.block_ids[op.skip_first_n_tokens // self.config.block_size :])
            if missing:
                failed.add(transfer.request_id)
                self._load_error_blocks.update(missing)
        self._loads = []
        self._load_ops = []
        self._layered = []
        self._load_failed = failed
        return failed

    def note_load_errors(self, block_ids: Iterable[int]) -> None:
        """Report blocks as not loaded (the engine recomputes them)."""
        self._load_error_blocks.update(block_ids)

    def fail_loads(self, ops: Iterable[RetrieveOp]) -> None:
        """Report every block of ``ops`` past the engine's own hit as not loaded.

        Waits for retrieves already started first: storage may still be copying
        into those blocks, and the engine is about to recompute them.
        """
        for transfer in self._loads:
            with contextlib.suppress(Exception):
                transfer.future.result()
        self._loads = []
        self._load_ops = []
        self._layered = []
        for op in ops:
            skip = op.skip_first_n_tokens // self.config.block_size
            self._load_error_blocks.update(op.block_ids[skip:])
            self._load_failed.add(op.request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that retrieves failed to fill since the last call (the engine recomputes them)."""
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def save_kv(self, metadata: ConnectorMetadata, producer_event: bytes = b"") -> None:
        """Start the step's stores (after the forward pass wrote the KV).

        ``producer_event`` (GPU): IPC handle of a CUDA event recorded after the
        forward; storage's copies out of the blocks wait for it.
        """
        self._require(KVConnectorRole.WORKER)
        failed, self._load_failed = self._load_failed, set()
        for op in metadata.store_ops:
            if op.request_id in failed:  # computed over blocks no load filled: wrong KV
                logger.warning("not storing %s: its load fell short", op.request_id)
                continue
            future = self._executor().submit(self._store, op, producer_event)
            self._saves.append(_Transfer(op.request_id, future))

    def poll_saves(self) -> tuple[set[str], set[str]]:
        """Without blocking: (requests whose started stores all finished, requests still storing).

        Finished stores are forgotten; a failed store counts as finished (it was logged).
        """
        running = {t.request_id for t in self._saves if not t.future.done()}
        done = {t.request_id for t in self._saves if t.future.done()} - running
        self._saves = [t for t in self._saves if not t.future.done()]
        return done, running

    def finish_saves_of(self, request_ids: Collection[str]) -> int:
        """Wait for the started stores of ``request_ids``; how many were still running.

        The engine freed those requests' blocks (it preempted them) and the next
        forward pass may write them: a store still copying out of them would
        save another request's KV under this prompt's keys. A store that fails
        counts as finished (it was logged).
        """
        wanted = set(request_ids)
        running = [t for t in self._saves if t.request_id in wanted and not t.future.done()]
        for transfer in running:
            try:
                transfer.future.result()
            except Exception:  # _store logs its own failures; anything else is logged here
                logger.exception("store of %s failed", transfer.request_id)
        return len(running)

    def wait_for_save(self) -> set[str]:
        """Wait for the started stores; the ids of requests whose store failed."""
        failed = set()
        for transfer in self._saves:
            try:
                if transfer.future.result():
                    failed.add(transfer.request_id)
            except Exception:
                logger.exception("store of %s failed", transfer.request_id)
                failed.add(transfer.request_id)
        self._saves = []
        return failed
