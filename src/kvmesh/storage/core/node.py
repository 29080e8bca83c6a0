"""StorageNode: what a storage RPC does, as plain Python over the storage core.

It joins the :class:`~kvmesh.storage.core.manager.StorageManager` (L1, L2,
controllers), the :class:`~kvmesh.storage.core.transfer.engine.TransferEngine`
(the engines' mapped KV memory) and the request-level bookkeeping the
contract promises: prefetch ids whose completed result is delivered once
(:mod:`~kvmesh.storage.core.prefetch_ids`), engine-driven transactions
(:mod:`~kvmesh.storage.core.transactions`), the node's own copies with their
locking rules (:mod:`~kvmesh.storage.core.copies`), per-chunk release of
lookup locks, and the coordinator's node commands (delete keys, set a quota,
resync). It checks every request's arguments before it delegates. The
servicer converts protobuf at the edge.

Threads (see the storage app's docstring for the whole process): every
method runs on the event loop, except the copies, which run on the copy
executor the app hands in (torch and the native kernel release the GIL), so
the loop keeps serving other RPCs meanwhile. A wait for a prefetch
(``wait_ms``) parks no thread at all (see
:mod:`~kvmesh.storage.core.prefetch_ids`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from kvmesh.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kvmesh.common.events import Tier
from kvmesh.common.keys import (
    ObjectKey,
    validate_cache_salt,
    validate_object_key,
    validate_object_keys,
)
from kvmesh.common.layer_range import check_layer_range
from kvmesh.common.long_lived import freeze_more
from kvmesh.common.node_types import PrefetchState, Slot, StoreOutcome
from kvmesh.storage.core import inventory
from kvmesh.storage.core.copies import ChunkCopier
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.l1_events import L1_BACKEND
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.node_lookups import MAX_CHUNK_BYTES, NodeLookups
from kvmesh.storage.core.node_segments import NodeSegments
from kvmesh.storage.core.transactions import EngineTransactions
from kvmesh.storage.core.transfer.engine import KVHandle, TransferEngine, load_copy_half
from kvmesh.storage.core.transfer.layout import KVLayout, chunk_nbytes

logger = logging.getLogger(__name__)

MAX_DELETE_KEYS = 10_000
#: A lookup's lease ends this long after the lookup: below the L1 read-lock TTL's
#: default (300 s), so a lease ends before its locks could lapse.
DEFAULT_LEASE_TTL_S = 240.0
#: A lease's TTL is at most this share of the read-lock TTL (a shorter read TTL).
LEASE_SHARE_OF_READ_TTL = 0.8


class StorageNode:
    """Request semantics of ``kvmesh.storage.v1.StorageService`` over the storage core."""

    def __init__(
        self,
        manager: StorageManager,
        transfer: TransferEngine,
        *,
        max_chunks_per_request: int = 4096,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        copy_executor: Executor | None = None,
        load_executor: Executor | None = None,
        store_copy_threads: int | None = 1,
    ) -> None:
        """``copy_executor`` runs the stores' gathers, ``load_executor`` the retrieves'
        scatters (the app sizes both); None = own. ``store_copy_threads``: threads one
        store's CPU copy uses (None: as many as a load's)."""
        self.manager = manager
        self.transfer = transfer
        self.max_chunks = max_chunks_per_request
        self._ids = itertools.count(1)
        self.lookups = NodeLookups(
            manager, new_id=self._new_id, max_chunks=max_chunks_per_request,
            # A lease must end before the L1 read locks it holds could lapse.
            lease_ttl_s=min(lease_ttl_s, LEASE_SHARE_OF_READ_TTL * manager.l1.read_ttl_s),
            clock=clock,
        )  # fmt: skip
        self._txns = EngineTransactions(manager, clock=clock, new_id=self._new_id)
        self._copier = ChunkCopier(
            manager, transfer, copy_executor, load_executor, store_copy_threads
        )
        self.segments = NodeSegments(manager, self._copier, self._layout)
        self._copies_loaded = False

    @property
    def waiting(self) -> int:
        """Prefetch waits parked right now."""
        return self.lookups.prefetches.waiting

    # ----------------------------------------------------------------- engines

    async def load_copies(self) -> None:
        """Before a registration: load torch (a second of CPU) on a copy thread, not the loop."""
        if not self._copies_loaded:
            await self._copier.run(load_copy_half)
            self._copies_loaded = True
            # torch's objects, most of the process's, out of full collections
            # (common/long_lived.py).
            freeze_more("torch and the copy code")

    def register_engine(
        self, engine_id: str, layout: KVLayout, handles: Sequence[KVHandle]
    ) -> bool:
        """Map an engine's KV memory; True when it was registered already (same layout)."""
        if not engine_id:
            raise InvalidArgument("engine_id must not be empty", field="engine_id")
        already = self.transfer.is_registered(engine_id)
        try:
            self.transfer.register(engine_id, layout, handles)
        except FailedPrecondition as exc:
            if already:
                raise AlreadyExists(
                    f"engine {engine_id!r} is registered with a different layout or memory; "
                    "unregister it first",
                    reason="ENGINE_LAYOUT_MISMATCH",
                ) from exc
            raise
        if not already:
            self._copier.prefault(engine_id)
        return already

    def unregister_engine(self, engine_id: str) -> bool:
        """Unmap an engine's memory; False when it was not registered."""
        if not self.transfer.is_registered(engine_id):
            return False
        self.transfer.unregister(engine_id)
        return True

    def _layout(self, engine_id: str) -> KVLayout:
        if not self.transfer.is_registered(engine_id):
            raise FailedPrecondition(
                f"engine {engine_id!r} has not registered its KV memory with this node",
                reason="ENGINE_NOT_REGISTERED",
                metadata={"engine_id": engine_id},
            )
        return self.transfer.layout(engine_id)

    def _check_keys(self, keys: Sequence[ObjectKey], field: str = "keys") -> None:
        if len(keys) > self.max_chunks:
            raise InvalidArgument(
                f"{len(keys)} chunks exceed this node's limit of {self.max_chunks} per request",
                field=field,
            )
        validate_object_keys(keys, field)

    def _check_grid_keys(self, keys: Sequence[ObjectKey]) -> None:
        # A flattened KeyGrid (lock release, touch): same bound as a lookup's grid.
        if len(keys) > self.max_chunks * 8:
            raise InvalidArgument("the key grid is too large", field="keys")
        validate_object_keys(keys, "keys")

    def _chunk_blocks(
        self, layout: KVLayout, n_chunks: int, block_ids: Sequence[int], chunk_tokens: int
    ) -> list[list[int]]:
        if chunk_tokens < 1 or chunk_tokens % layout.block_size:
            raise InvalidArgument(
                f"chunk_tokens {chunk_tokens} is not a positive multiple of the engine's block "
                f"size {layout.block_size}",
                field="chunk_tokens",
            )
        per_chunk = chunk_tokens // layout.block_size
        if len(block_ids) < n_chunks * per_chunk:
            raise InvalidArgument(
                f"{n_chunks} chunks need {n_chunks * per_chunk} block ids, got {len(block_ids)}",
                field="block_ids",
            )
        for i, block in enumerate(block_ids[: n_chunks * per_chunk]):
            if not 0 <= block < layout.num_blocks:
                raise InvalidArgument(
                    f"block_ids[{i}] = {block} is outside the engine's {layout.num_blocks} blocks",
                    field="block_ids",
                )
        return [list(block_ids[i * per_chunk : (i + 1) * per_chunk]) for i in range(n_chunks)]

    # ------------------------------------------------------------------ stores

    async def store_chunks(
        self,
        engine_id: str,
        keys: Sequence[ObjectKey],
        block_ids: Sequence[int],
        chunk_tokens: int,
        producer_event: bytes = b"",
    ) -> list[StoreOutcome]:
        """Gather each chunk into a new L1 object and publish it; one outcome per key."""
        layout = self._layout(engine_id)
        self._check_keys(keys)
        blocks = self._chunk_blocks(layout, len(keys), block_ids, chunk_tokens)
        if not keys:
            return []
        nbytes = chunk_nbytes(layout, chunk_tokens)
        return await self._copier.store(
            engine_id, keys, blocks, chunk_tokens, nbytes, producer_event
        )

    # ---------------------------------------------------------------- lookups

    def _new_id(self, prefix: str) -> str:
        """A node-unique id for a prefetch or a transaction."""
        return f"{prefix}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    async def lookup_and_lock(
        self,
        request_id: str,
        rows: Sequence[Sequence[ObjectKey]],
        readers: int,
        wait_ms: int,
        chunk_bytes: int = 0,
        *,
        allow_peers: bool = True,
        owner: str = "",
        leased: bool = True,
    ) -> PrefetchState:
        """Lock the prefix present in every row; see :class:`NodeLookups`."""
        return await self.lookups.lookup_and_lock(
            request_id, rows, readers, wait_ms, chunk_bytes,
            allow_peers=allow_peers, owner=owner, leased=leased,
        )  # fmt: skip

    async def prefetch_status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        """Status of a prefetch; a completed result is delivered once, then forgotten."""
        return await self.lookups.prefetch_status(prefetch_id, wait_ms)

    def release_prefetch(self, prefetch_id: str) -> bool:
        """Abandon a prefetch: its locks are released as soon as it finishes (now if it has)."""
        return self.lookups.release_prefetch(prefetch_id)

    # -------------------------------------------------------------- retrieves

    async def retrieve_chunks(
        self,
        engine_id: str,
        keys: Sequence[ObjectKey],
        block_ids: Sequence[int],
        chunk_tokens: int,
        skip_first_n_tokens: int,
        lease_id: str = "",
        producer_event: bytes = b"",
        layers: tuple[int, int] | None = None,
    ) -> int:
        """Scatter the resident prefix of ``keys`` into the engine; chunks copied.

        The lookup locks ``lease_id`` holds on ``keys`` leave the lease now and are
        released when the copy ends, whatever its outcome (exactly once). With
        ``layers`` only layers ``[start, end)`` are written, and only a range that
        ends at the last layer takes the lease's locks: the earlier parts of a load
        by layers leave them to hold the chunks for the parts still to come.
        """
        layout = self._layout(engine_id)
        self._check_keys(keys)
        if layers is not None:
            check_layer_range(layout.num_layers, *layers)
        if skip_first_n_tokens > len(keys) * chunk_tokens:
            raise InvalidArgument(
                "skip_first_n_tokens is beyond the chunks", field="skip_first_n_tokens"
            )
        blocks = self._chunk_blocks(layout, len(keys), block_ids, chunk_tokens)
        nbytes = chunk_nbytes(layout, chunk_tokens)
        last_part = layers is None or layers[1] == layout.num_layers
        if last_part:
            release_mask = self.lookups.leases.consume(lease_id, keys)
        else:
            release_mask = [False] * len(keys)
        return await self._copier.retrieve(
            engine_id, keys, blocks, chunk_tokens, nbytes, skip_first_n_tokens, release_mask,
            producer_event, layers, last_part,
            1.0 if layers is None else (layers[1] - layers[0]) / layout.num_layers,
        )  # fmt: skip

    # ------------------------------------------------------------ locks & misc

    def release_locks(self, keys: Sequence[ObjectKey], count: int) -> tuple[int, int]:
        """Release ``count`` read locks per key; (released, skipped)."""
        self._check_grid_keys(keys)
        results = self.manager.finish_read(keys, max(count, 1))
        released = sum(1 for r in results if r is L1Result.SUCCESS)
        return released, len(results) - released

    def touch(self, keys: Sequence[ObjectKey]) -> int:
        """Refresh LRU recency of resident keys."""
        self._check_grid_keys(keys)
        return self.manager.touch(keys)

    def delete(
        self, keys: Sequence[ObjectKey], tier: Tier | None, backend: str, force: bool
    ) -> tuple[int, int]:
        """Delete keys from a tier (None = both); (deleted, skipped)."""
        if len(keys) > MAX_DELETE_KEYS:
            raise InvalidArgument(
                f"at most {MAX_DELETE_KEYS} keys per delete, got {len(keys)}", field="keys"
            )
        for i, key in enumerate(keys):
            validate_object_key(key, field=f"keys[{i}]")
        # A backend names one of this node's media: L1's ("dram") or an L2 adapter
        # (by backend or adapter name); "" = every backend of the tier(s). The
        # coordinator names the backend of each placement it deletes, L1's too.
        # With both tiers an L2 name limits the L2 part only, "dram" skips L2.
        l2_names = {t.backend for t in self.manager.tiers} | {t.name for t in self.manager.tiers}
        if backend:
            known = ({L1_BACKEND} if tier in (None, Tier.L1) else set()) | (
                l2_names if tier in (None, Tier.L2) else set()
            )
            if backend not in known:
                which = "backend" if tier is None else f"{tier.name} backend"
                raise InvalidArgument(
                    f"unknown {which} {backend!r}; this node has "
                    f"L1 {[L1_BACKEND]} and L2 {sorted(l2_names)}",
                    field="backend",
                )
        # Counted per key and tier: absent keys count as skipped (the contract).
        deleted = 0
        tiers = 0
        if tier in (None, Tier.L1):
            deleted += self.manager.delete(keys, Tier.L1, force=force)[0]
            tiers += 1
        if tier in (None, Tier.L2) and backend != L1_BACKEND:
            deleted += self.manager.delete(keys, Tier.L2, force=force, backend=backend)[0]
            tiers += sum(
                1 for t in self.manager.tiers if not backend or backend in (t.backend, t.name)
            )
        return deleted, len(keys) * tiers - deleted

    async def clear(self, force: bool) -> int:
        """Drop L1 objects (locked ones too with force); never a write-through still owed.

        Waits (off the loop) for the L2 write-through of objects still queued,
        as the manager's ``clear`` does, so the loop keeps serving meanwhile.
        """
        deleted, _ = await asyncio.to_thread(self.manager.clear, force=force)
        return deleted

    # ---------------------------------------------------------- engine-driven

    def _check_chunk_bytes(self, chunk_bytes: int) -> None:
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]", field="chunk_bytes"
            )

    def prepare_store(
        self,
        keys: Sequence[ObjectKey],
        chunk_bytes: int,
        segment_tokens: Sequence[int] | np.ndarray = (),
    ) -> tuple[str, list[Slot], int, int]:
        """Reserve slots for uncached keys: (transaction, slots, cached, skipped).

        ``segment_tokens``: ``keys`` is one CacheBlend segment made of these tokens,
        indexed for :meth:`NodeSegments.find` (a hint, checked when found).
        """
        self._check_keys(keys)
        self._check_chunk_bytes(chunk_bytes)
        if len(segment_tokens):
            self.segments.note(keys, segment_tokens, "segment_token_ids")
        return self._txns.prepare_store(keys, chunk_bytes)

    def commit_store(self, transaction_id: str) -> int:
        """Publish a prepared store. A repeated commit (lost reply) publishes nothing more."""
        return self._txns.commit_store(transaction_id)

    def prepare_retrieve(
        self, keys: Sequence[ObjectKey], chunk_bytes: int
    ) -> tuple[str, list[Slot]]:
        """Read-lock the resident prefix and return its slots."""
        self._check_keys(keys)
        self._check_chunk_bytes(chunk_bytes)
        return self._txns.prepare_retrieve(keys, chunk_bytes)

    def commit_retrieve(self, transaction_id: str, lease_id: str = "") -> int:
        """Release a prepared retrieve's locks, and the lookup locks ``lease_id`` holds on them."""
        keys = self._txns.retrieve_keys(transaction_id)
        return self._txns.commit_retrieve(
            transaction_id, self.lookups.leases.consume(lease_id, keys)
        )

    def expire_transactions(self) -> int:
        """Forget engine-driven transactions older than their lock TTL (engine gone).

        An expired store's reservation is discarded at once; an expired
        retrieve's read locks have lapsed already (TTL locks). A later commit
        of either is NOT_FOUND. Prefetch ids whose result expired unqueried
        are forgotten too. Returns how many transactions expired.
        """
        try:
            return self._txns.expire()
        finally:
            self.lookups.expire()  # leases end on time even if the transactions' sweep fails

    # -------------------------------------------------------------- commands

    def handle_command(self, command: Any) -> int:
        """Execute a coordinator command (the emitter's CommandHandler protocol)."""
        from kvmesh.storage.core.ports import (
            DeleteKeysCommand,
            QuotaChangedCommand,
            ResyncCommand,
        )

        if isinstance(command, DeleteKeysCommand):
            deleted, _ = self.delete(command.keys, command.tier, command.backend, command.force)
            return deleted
        if isinstance(command, QuotaChangedCommand):
            return self.apply_quota(command.cache_salt, command.tier, command.quota_bytes)
        if isinstance(command, ResyncCommand):
            return self.resync(command.tier)
        raise InvalidArgument(f"unknown command {type(command).__name__}")

    def apply_quota(self, cache_salt: str, tier: Tier, limit_bytes: int | None) -> int:
        """Set (or with None remove) one tier of a salt's quota."""
        return inventory.apply_quota(self.manager, cache_salt, tier, limit_bytes)

    def resync(self, tier: Tier | None) -> int:
        """Re-announce every placement this node holds as STORE events (see :mod:`.inventory`)."""
        return inventory.resync(self.manager, tier)

    # ---------------------------------------------------------------- quotas

    @staticmethod
    def check_salt(cache_salt: str) -> None:
        """InvalidArgument unless the salt is usable in a key."""
        validate_cache_salt(cache_salt)

    def salt_usage(self, cache_salt: str, tier: Tier) -> tuple[int, int | None]:
        """(bytes the salt holds on the tier, its explicit limit or None)."""
        return inventory.salt_usage(self.manager, cache_salt, tier)

    def salts(self, tier: Tier) -> list[str]:
        """Salts with bytes on the tier or a quota for it."""
        return inventory.salts(self.manager, tier)

    def list_objects(
        self, tier: Tier | None, backend: str, model_name: str
    ) -> list[tuple[ObjectKey, Tier, str, int]]:
        """Objects held by this node (a snapshot), L1 first, then each adapter."""
        return inventory.list_objects(self.manager, tier, backend, model_name)

    # ---------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        """The manager's status plus node-level counters."""
        data = self.manager.status()
        data["active_prefetches"] = len(self.lookups.prefetches)
        data["lookup_leases"] = len(self.lookups.leases)
        data["lease_locks"] = self.lookups.leases.held_locks
        data["lease_stats"] = self.lookups.leases.stats
        data["open_transactions"] = len(self._txns)
        data["waiting_calls"] = self.waiting
        data["engines"] = self.transfer.instance_ids()
        data["copies"] = self._copier.stats.snapshot()
        return data

    def close(self) -> None:
        """Stop the copy executor if the node made it (the app closes the one it passed in).

        Waits for running copies; the manager and transfer engine close separately, after.
        """
        self._copier.close()
