"""Engine-driven transactions: L1 slots that an engine copies into or out of itself.

``prepare_store`` reserves L1 objects for the uncached keys and hands out
their shared-memory slots; ``commit_store`` publishes them. ``prepare_retrieve``
read-locks the resident prefix and hands out its slots; ``commit_retrieve``
releases those locks and the lookup locks the caller flags. The engine does
the copies, so the node only keeps the open transactions: each lives until it
is committed, or until its lock TTL passes (the engine is presumed gone, see
:meth:`EngineTransactions.expire`). A repeated commit (a lost reply) is
harmless. Arguments are checked by the caller
(:class:`~kvmesh.storage.core.node.StorageNode`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.common.errors import Aborted, NotFound, ResourceExhausted
from kvmesh.common.keys import ObjectKey
from kvmesh.common.node_types import Slot
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.manager import StorageManager

logger = logging.getLogger(__name__)

PREPARE_TAG = "engine-driven"
_COMMITTED_KEPT = 4096


@dataclass(frozen=True, slots=True)
class _ReadTxn:
    keys: list[ObjectKey]  # the keys asked for, in chunk order (release_mask indexes them)
    held: list[ObjectKey]  # the prefix this transaction read-locked


class EngineTransactions:
    """The node's open engine-driven transactions (thread-safe).

    ``new_id(prefix)`` names a transaction (unique on the node); ``clock``
    times their expiry.
    """

    def __init__(
        self,
        manager: StorageManager,
        *,
        clock: Callable[[], float],
        new_id: Callable[[str], str],
    ) -> None:
        self.manager = manager
        self._clock = clock
        self._new_id = new_id
        self._txn_deadlines: dict[str, float] = {}
        self._store_txns: dict[str, list[ObjectKey]] = {}
        self._read_txns: dict[str, _ReadTxn] = {}
        # Recently committed transactions, so a retried commit is harmless (idempotent).
        self._committed: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Open transactions (stores and retrieves)."""
        with self._lock:
            return len(self._store_txns) + len(self._read_txns)

    def prepare_store(
        self, keys: Sequence[ObjectKey], chunk_bytes: int
    ) -> tuple[str, list[Slot], int, int]:
        """Reserve slots for uncached keys: (transaction, slots, cached, skipped)."""
        present = self.manager.l1.contains(keys)
        reserved = self.manager.reserve_write(keys, chunk_bytes, tag=PREPARE_TAG)
        slots = []
        for i, key in enumerate(keys):
            obj = reserved.get(key)
            if obj is not None:
                where = obj.location()
                slots.append(Slot(i, where.path, where.offset, where.size))
        cached = sum(1 for p in present if p)
        skipped = len(keys) - cached - len(slots)
        if not slots:
            if skipped:
                raise ResourceExhausted("no chunk fits in L1 right now", reason="L1_FULL")
            return "", [], cached, 0
        txn = self._new_id("store")
        with self._lock:
            self._store_txns[txn] = [k for k in keys if k in reserved]
            self._txn_deadlines[txn] = self._clock() + self.manager.l1.write_ttl_s
        return txn, slots, cached, skipped

    def commit_store(self, transaction_id: str) -> int:
        """Publish a prepared store. A repeated commit (lost reply) publishes nothing more."""
        with self._lock:
            keys = self._store_txns.pop(transaction_id, None)
            self._txn_deadlines.pop(transaction_id, None)
            repeat = keys is None and transaction_id in self._committed
            if keys is not None:
                self._remember_committed(transaction_id)
        if repeat:
            return 0
        if keys is None:
            raise NotFound(
                f"unknown store transaction {transaction_id!r}", reason="UNKNOWN_TRANSACTION"
            )
        results = self.manager.finish_write(keys, tag=PREPARE_TAG)
        return sum(1 for r in results if r is L1Result.SUCCESS)

    def prepare_retrieve(
        self, keys: Sequence[ObjectKey], chunk_bytes: int
    ) -> tuple[str, list[Slot]]:
        """Read-lock the resident prefix and return its slots."""
        locked_at = self._clock()  # the locks lapse a read TTL after this, at the latest
        results = self.manager.reserve_read(keys, 1) if keys else []
        prefix = 0
        while prefix < len(keys) and results[prefix] is L1Result.SUCCESS:
            prefix += 1
        beyond = [
            k for k, r in zip(keys[prefix:], results[prefix:], strict=True) if r is L1Result.SUCCESS
        ]
        if beyond:
            self.manager.finish_read(beyond, 1)
        objects = self.manager.unsafe_read(keys[:prefix])
        slots = []
        held = []
        for i, key in enumerate(keys[:prefix]):
            obj = objects.get(key)
            if obj is None or obj.size != chunk_bytes:
                break
            where = obj.location()
            slots.append(Slot(i, where.path, where.offset, where.size))
            held.append(key)
        unused = keys[len(held) : prefix]
        if unused:
            self.manager.finish_read(unused, 1)
        if not held:
            return "", []
        txn = self._new_id("read")
        with self._lock:
            self._read_txns[txn] = _ReadTxn(list(keys), held)
            self._txn_deadlines[txn] = locked_at + self.manager.l1.read_ttl_s
        return txn, slots

    def retrieve_keys(self, transaction_id: str) -> list[ObjectKey]:
        """The keys a prepared retrieve asked for ([] when it is unknown or committed)."""
        with self._lock:
            txn = self._read_txns.get(transaction_id)
        return list(txn.keys) if txn is not None else []

    def commit_retrieve(self, transaction_id: str, release_mask: Sequence[bool]) -> int:
        """Release a prepared retrieve's locks and the flagged lookup locks."""
        with self._lock:
            txn = self._read_txns.pop(transaction_id, None)
            deadline = self._txn_deadlines.pop(transaction_id, None)
            lapsed = deadline is not None and self._clock() >= deadline
            repeat = txn is None and transaction_id in self._committed
            if txn is not None and not lapsed:
                self._remember_committed(transaction_id)
        if repeat:
            return 0  # a retried commit (lost reply): idempotent, releases nothing
        if txn is None:
            raise NotFound(
                f"unknown retrieve transaction {transaction_id!r}", reason="UNKNOWN_TRANSACTION"
            )
        flagged = [k for k, flag in zip(txn.keys, release_mask, strict=False) if flag]
        if flagged:
            self.manager.finish_read(flagged, 1)  # the lease's: alive when they were consumed
        if lapsed:
            # The prepare's locks lapsed before the commit (the sweep had not come by):
            # eviction may have reused the slots while the engine read them, and their
            # counts may be newer readers' now, so they are not released either.
            raise Aborted(
                f"retrieve transaction {transaction_id!r} committed after its read locks "
                f"lapsed ({self.manager.l1.read_ttl_s:g} s after the prepare): what the "
                "engine read may have been overwritten; discard it and prepare again",
                reason="LOCKS_LAPSED",
            )
        self.manager.finish_read(txn.held, 1)
        return len(txn.held)

    def _remember_committed(self, transaction_id: str) -> None:
        """Call with ``self._lock`` held."""
        self._committed[transaction_id] = None
        while len(self._committed) > _COMMITTED_KEPT:
            self._committed.popitem(last=False)

    def expire(self) -> int:
        """Forget transactions older than their lock TTL (engine gone); how many.

        An expired store's reservation is discarded at once; an expired
        retrieve's read locks have lapsed already (TTL locks). A later commit
        of either is NOT_FOUND.
        """
        now = self._clock()
        with self._lock:
            expired = [t for t, deadline in self._txn_deadlines.items() if deadline <= now]
            stores = []
            for txn in expired:
                del self._txn_deadlines[txn]
                keys = self._store_txns.pop(txn, None)
                if keys is not None:
                    stores.append(keys)
                self._read_txns.pop(txn, None)
        for keys in stores:
            self.manager.abort_write(keys, tag=PREPARE_TAG)
        if expired:
            logger.warning("%d engine-driven transactions expired uncommitted", len(expired))
        return len(expired)
