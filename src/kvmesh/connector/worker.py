"""Worker half of the connector: retrieves and stores (its KV registration: worker_registration).

See docs/connector.md, "Worker flow".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.connector.layered import LayeredLoad, layer_groups
from kvmesh.connector.metadata import ConnectorMetadata, RetrieveOp, StoreOp
from kvmesh.connector.types import (
    KVConnectorRole,
    KVMeshConnectorConfig,
    rpc_failure,
)
from kvmesh.connector.worker_registration import WorkerRegistration
from kvmesh.gateway.client import GatewayClient

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


class WorkerHooks(WorkerRegistration):
    """The worker-side hooks (one instance per engine worker process)."""

    def __init__(
        self,
        config: KVMeshConnectorConfig,
        role: KVConnectorRole,
        *,
        client: GatewayClient | None = None,
    ) -> None:
        super().__init__(config, role, client=client)
        self._pool: ThreadPoolExecutor | None = None
        self._loads: list[_Transfer] = []
        self._load_ops: list[RetrieveOp] = []
        self._layered: list[LayeredLoad] = []
        self._saves: list[_Transfer] = []
        self._load_error_blocks: set[int] = set()
        self._load_failed: set[str] = set()  # last loads fell short: not stored (save_kv)

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
