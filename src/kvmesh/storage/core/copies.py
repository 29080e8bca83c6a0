"""ChunkCopier: the node's own copies between an engine's KV memory and L1, and their locks.

StoreChunks gathers from the engine into L1 and RetrieveChunks scatters from
L1 into the engine; the copies run on the copy executor (torch and the native
kernel release the GIL), so the event loop keeps serving other RPCs
meanwhile. Arguments are checked by the caller
(:class:`~kvmesh.storage.core.node.StorageNode`).

Locking rules on the data path:
- a store reserves L1 objects, gathers into them, then publishes them; a
  failed copy discards the reservation at once (no wait for the write TTL);
- a retrieve read-locks each object for the duration of its copy, so
  eviction can never free memory under it, and separately releases the
  lookup locks the caller says it holds (``release_mask``);
- a copy never starts when its caller's deadline is less than
  :data:`~kvmesh.common.deadlines.COPY_START_MARGIN_S` away (checked on the
  copy thread, after any wait for a free one): an engine that gave up on the
  call recomputes or reuses those blocks, and a late copy would corrupt them
  (or store another request's KV). The call fails with DEADLINE_EXCEEDED
  instead, having touched no engine memory.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kvmesh.common.deadlines import CALL_DEADLINE, COPY_START_MARGIN_S
from kvmesh.common.errors import DeadlineExceeded
from kvmesh.common.keys import ObjectKey
from kvmesh.common.node_types import StoreOutcome
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.transfer.engine import TransferEngine

if TYPE_CHECKING:  # the copies run only once an engine registered, which loads torch
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


def default_copy_threads() -> int:
    """Size of the copy executor: a thread per core, 2 to 8 (copies are memory-bound)."""
    return max(2, min(8, os.cpu_count() or 2))


@dataclass
class CopyTotals:
    """What the copies of one direction did since the node started (a copy that
    fails counts nowhere)."""

    copies: int = 0
    #: Bytes moved: the objects' bytes, less the tokens a retrieve skipped, times the
    #: share of the layers a part of a load by layers wrote.
    bytes: int = 0
    #: Time on the copy thread, from the copy's start to its end (no wait for a thread).
    seconds: float = 0.0


class CopyStats:
    """The node's copies by direction ("store": engine → L1, "retrieve": L1 → engine),
    so an operator reads the copy's throughput and its share of a call's time
    (docs/observability.md)."""

    DIRECTIONS = ("store", "retrieve")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {d: CopyTotals() for d in self.DIRECTIONS}

    def add(self, direction: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            totals = self._totals[direction]
            totals.copies += 1
            totals.bytes += nbytes
            totals.seconds += seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{direction: {"copies", "bytes", "seconds"}}."""
        with self._lock:
            return {
                d: {"copies": t.copies, "bytes": t.bytes, "seconds": t.seconds}
                for d, t in self._totals.items()
            }


def _timed(stats: CopyStats, direction: str, nbytes: int, copy: Callable[[], T]) -> T:
    began = time.perf_counter()
    result = copy()
    stats.add(direction, nbytes, time.perf_counter() - began)
    return result


class ChunkCopier:
    """Stores and retrieves whose copies the node makes itself, on the copy executor."""

    def __init__(
        self,
        manager: StorageManager,
        transfer: TransferEngine,
        copy_executor: Executor | None = None,
        load_executor: Executor | None = None,
        store_copy_threads: int | None = 1,
    ) -> None:
        """``copy_executor`` runs the gathers (stores) and ``load_executor`` the scatters
        (retrieves), so a load never queues behind stores; each None = own.
        ``store_copy_threads``: threads one store's CPU copy uses (None: as many as a
        load's); an engine waits for its loads, not for its stores."""
        if store_copy_threads is not None and store_copy_threads < 1:
            raise ValueError(f"store_copy_threads must be >= 1 or None, got {store_copy_threads}")
        self.manager = manager
        self.transfer = transfer
        self.store_copy_threads = store_copy_threads
        self._owned = [
            ThreadPoolExecutor(max_workers=default_copy_threads(), thread_name_prefix=name)
            for name, given in (("kvmesh-transfer", copy_executor), ("kvmesh-load", load_executor))
            if given is None
        ]
        owned = iter(self._owned)
        self._copies = copy_executor or next(owned)
        self._loads = load_executor or next(owned)
        self.stats = CopyStats()

    async def store(
        self,
        engine_id: str,
        keys: Sequence[ObjectKey],
        blocks: list[list[int]],
        chunk_tokens: int,
        nbytes: int,
        producer_event: bytes = b"",
    ) -> list[StoreOutcome]:
        """Gather each chunk into a new L1 object and publish it; one outcome per key."""

        def gather(todo: list[int], views: list[torch.Tensor]) -> None:
            self.transfer.gather_chunks(
                engine_id, [blocks[i] for i in todo], [chunk_tokens] * len(todo), views,
                producer_event,
            )  # fmt: skip

        return await self._store(keys, nbytes, gather)

    async def store_segment(
        self,
        engine_id: str,
        key: ObjectKey,
        block_table: Sequence[int],
        start_token: int,
        num_tokens: int,
        nbytes: int,
    ) -> StoreOutcome:
        """Gather a request's tokens into one segment object (keys moved to 0..)."""

        def gather(todo: list[int], views: list[torch.Tensor]) -> None:
            self.transfer.gather_segment(engine_id, block_table, start_token, num_tokens, views[0])

        (outcome,) = await self._store([key], nbytes, gather)
        return outcome

    async def _store(
        self,
        keys: Sequence[ObjectKey],
        nbytes: int,
        gather: Callable[[list[int], list[torch.Tensor]], None],
    ) -> list[StoreOutcome]:
        """Reserve the uncached keys, ``gather(indices, views)`` into them, publish them."""
        present = self.manager.l1.contains(keys)
        await self.manager.make_room([nbytes] * (len(keys) - sum(present)))
        reserved = self.manager.reserve_write(keys, nbytes)
        todo = [i for i, key in enumerate(keys) if key in reserved]
        if todo:
            chosen = [keys[i] for i in todo]
            try:
                views = [reserved[k].tensor() for k in chosen]
                await self.run(
                    functools.partial(
                        _timed, self.stats, "store", len(todo) * nbytes,
                        functools.partial(self._store_copy, gather, todo, views),
                    )
                )  # fmt: skip
            except BaseException:
                self.manager.abort_write(chosen)
                raise
            self.manager.finish_write(chosen)
        outcomes = []
        for i, key in enumerate(keys):
            if key in reserved:
                outcomes.append(StoreOutcome.STORED)
            elif present[i]:
                outcomes.append(StoreOutcome.ALREADY_CACHED)
            else:
                # Being written by someone else right now counts as cached; otherwise no room.
                cached = self.manager.l1.contains([key])[0]
                outcomes.append(StoreOutcome.ALREADY_CACHED if cached else StoreOutcome.NO_MEMORY)
        return outcomes

    def _store_copy(
        self,
        gather: Callable[[list[int], list[torch.Tensor]], None],
        todo: list[int],
        views: list[torch.Tensor],
    ) -> None:
        """``gather(todo, views)`` on this copy thread, on at most ``store_copy_threads``."""
        # Loaded with the copies, when the first engine registered (it imports torch).
        from kvmesh.kernels.parallel import copies_limited_to

        with copies_limited_to(self.store_copy_threads):
            gather(todo, views)

    async def retrieve(
        self,
        engine_id: str,
        keys: Sequence[ObjectKey],
        blocks: list[list[int]],
        chunk_tokens: int,
        nbytes: int,
        skip_first_n_tokens: int,
        release_mask: Sequence[bool],
        producer_event: bytes = b"",
        layers: tuple[int, int] | None = None,
        last_part: bool = True,
        layer_share: float = 1.0,
    ) -> int:
        """Scatter the resident prefix of ``keys`` (only ``layers`` when given, which are
        ``layer_share`` of the model's) into the engine; chunks copied. Only the
        ``last_part`` of a load by layers counts as a use of the chunks (LRU recency,
        ACCESS events): once per load, not per part."""

        def scatter(views: list[torch.Tensor]) -> None:
            self.transfer.scatter_chunks(
                engine_id, blocks[: len(views)], [chunk_tokens] * len(views), views,
                skip_first_n_tokens, producer_event, layers,
            )  # fmt: skip

        def moved(objects: int) -> int:
            tokens = max(0, objects * chunk_tokens - skip_first_n_tokens)
            return round(tokens * nbytes / chunk_tokens * layer_share)

        return await self._retrieve(
            keys, nbytes, scatter, release_mask, count_use=last_part, moved=moved
        )

    async def retrieve_segment(
        self,
        engine_id: str,
        key: ObjectKey,
        block_table: Sequence[int],
        start_token: int,
        num_tokens: int,
        nbytes: int,
    ) -> bool:
        """Scatter a resident segment into a request's tokens (keys moved there)."""

        def scatter(views: list[torch.Tensor]) -> None:
            self.transfer.scatter_segment(engine_id, block_table, start_token, num_tokens, views[0])

        return await self._retrieve([key], nbytes, scatter, [False]) == 1

    async def _retrieve(
        self,
        keys: Sequence[ObjectKey],
        nbytes: int,
        scatter: Callable[[list[torch.Tensor]], None],
        release_mask: Sequence[bool],
        *,
        count_use: bool = True,
        moved: Callable[[int], int] | None = None,
    ) -> int:
        """Read-lock the resident prefix of ``keys``, ``scatter(views)`` it; objects copied.

        ``moved(n)``: the bytes a scatter of ``n`` objects moves (default: theirs)."""
        results = self.manager.reserve_read(keys, 1) if keys else []
        prefix = 0
        while prefix < len(keys) and results[prefix] is L1Result.SUCCESS:
            prefix += 1
        locked = [k for k, r in zip(keys, results, strict=True) if r is L1Result.SUCCESS]
        usable = 0
        try:
            objects = self.manager.unsafe_read(keys[:prefix])
            while usable < prefix and objects.get(keys[usable]) is not None:
                if objects[keys[usable]].size != nbytes:
                    logger.warning(
                        "object %s holds %d bytes, the engine's copy needs %d; treating as a miss",
                        keys[usable].describe(),
                        objects[keys[usable]].size,
                        nbytes,
                    )
                    break
                usable += 1
            if usable:
                views = [objects[k].tensor() for k in keys[:usable]]
                nbytes_moved = moved(usable) if moved is not None else usable * nbytes
                await self.run(
                    functools.partial(
                        _timed, self.stats, "retrieve", nbytes_moved,
                        functools.partial(scatter, views),
                    ),
                    self._loads,
                )  # fmt: skip
        finally:
            self.manager.finish_read(locked, 1)
            flagged = [k for k, flag in zip(keys, release_mask, strict=False) if flag]
            if flagged:
                self.manager.finish_read(flagged, 1)
        if usable and count_use:
            # A served chunk is a use: refresh its LRU recency and report ACCESS, so the
            # coordinator's access counts follow real reuse.
            self.manager.touch(keys[:usable])
        return usable

    def prefault(self, engine_id: str) -> None:
        """Map an engine's KV memory on a copy thread, in the background (see
        :meth:`TransferEngine.prefault`); a failure is logged, never raised."""
        try:
            future = self._copies.submit(self.transfer.prefault, engine_id)
        except RuntimeError:  # the node is shutting down: nothing to map ahead for
            return
        future.add_done_callback(functools.partial(_log_prefault_failure, engine_id))

    async def run(self, copy: Callable[[], T], executor: Executor | None = None) -> T:
        """Run a copy on ``executor`` (default: the copy executor, where stores run); return
        only once it no longer touches memory.

        A copy cannot be interrupted: a caller cancelled meanwhile still waits
        for it (then re-raises), so the L1 objects and locks it uses are never
        given back under it. It does not start at all when the served call's
        deadline is too close (see the module docstring).
        """
        deadline = CALL_DEADLINE.get()
        if deadline is not None:
            copy = functools.partial(_before, deadline, copy)
        future = asyncio.get_running_loop().run_in_executor(executor or self._copies, copy)
        cancelled = False
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            if not future.cancelled():
                future.exception()  # retrieved: nobody is left to report it to
            raise asyncio.CancelledError
        return future.result()

    def close(self) -> None:
        """Stop the executors this made (the app closes those it passed in).

        Waits for running copies.
        """
        for executor in self._owned:
            executor.shutdown(wait=True)


def _before(deadline: float, copy: Callable[[], T]) -> T:
    """Run ``copy`` unless the caller's deadline is too close for it (on the copy thread)."""
    left = deadline - time.monotonic()
    if left < COPY_START_MARGIN_S:
        raise DeadlineExceeded(
            f"the caller's deadline is {max(left, 0.0) * 1e3:.0f} ms away: the copy was not "
            "started (the engine no longer waits for it)",
            reason="COPY_NOT_STARTED",
        )
    return copy()


def _log_prefault_failure(engine_id: str, future: Future[int]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning(
            "mapping engine %s's KV memory ahead of its copies failed (copies fault pages in "
            "as they go): %s",
            engine_id,
            future.exception(),
        )
