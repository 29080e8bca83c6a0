"""One L2 adapter as the node uses it: health, a byte/LRU index, placement events.

Every adapter call of the storage node goes through :class:`L2Tier`, which

- turns a failure (``L2Unavailable``, any other exception, or an answer of
  the wrong shape) into ``L2Unavailable`` for the caller and marks the
  adapter *degraded*: the node keeps serving from L1 alone for it, calls are
  refused at once (no waiting on a dead backend per request) until an
  exponential backoff has passed, then one call probes it again;
- keeps the index of what the adapter holds (sizes per key, recency, bytes
  per cache_salt) that L2 eviction, quotas and prefetch sizing use;
- reports every L2 placement change (STORE, DELETE, ACCESS) to the event
  sink in the same order as the index changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l2.base import L2Adapter, L2ObjectCorrupt, L2Unavailable
from kvmesh.storage.core.lru import ByteLRU
from kvmesh.storage.core.ports import EventSink

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_BACKOFF_S = 5.0
DEFAULT_MAX_BACKOFF_S = 60.0
_INDEX_EVENT_BATCH = 1024


class L2Tier:
    """Health-checked, indexed, event-reporting wrapper of one L2 adapter. Thread-safe."""

    def __init__(
        self,
        adapter: L2Adapter,
        *,
        name: str | None = None,
        sink: EventSink | None = None,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.adapter = adapter
        self.backend = adapter.backend
        self.shared = bool(adapter.shared)
        #: The index alone can tell a key is absent (see :meth:`surely_absent`).
        self.sole_writer = bool(getattr(adapter, "sole_writer", False)) and not self.shared
        self.name = name or adapter.backend
        self.index = ByteLRU()
        self.declared_capacity_bytes = 0
        self.index_state = "pending"
        self._sink = sink
        self._clock = clock
        self._backoff_base = backoff_s
        self._backoff_max = max_backoff_s
        self._lock = threading.Lock()  # health fields
        self._event_lock = threading.Lock()  # index change + event, in one order
        self._degraded = False
        self._backoff = backoff_s
        self._retry_at = 0.0
        self.last_error = ""
        # Counters.
        self.failures = 0
        self.rejected_calls = 0
        self.stored_keys = 0
        self.store_failed_keys = 0
        self.loaded_keys = 0
        self.load_failed_keys = 0
        self.deleted_keys = 0

    # -- health -----------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """True after a failure until a call succeeds again."""
        with self._lock:
            return self._degraded

    def available(self) -> bool:
        """Whether a call would be attempted now (healthy, or degraded with backoff over)."""
        with self._lock:
            return not self._degraded or self._clock() >= self._retry_at

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._degraded and self._clock() < self._retry_at:
                self.rejected_calls += 1
                raise L2Unavailable(
                    f"L2 adapter {self.name} is degraded ({self.last_error}); "
                    f"next retry in {self._retry_at - self._clock():.1f}s"
                )
        try:
            result = fn()
        except (L2ObjectCorrupt, InvalidArgument) as exc:
            # One bad object or request is not a dead backend: fail this call only.
            logger.warning("L2 adapter %s %s failed for this call: %s", self.name, op, exc)
            if isinstance(exc, L2Unavailable):
                raise
            raise L2Unavailable(f"L2 adapter {self.name} {op} refused: {exc}") from exc
        except Exception as exc:
            self._mark_failed(op, exc)
            if isinstance(exc, L2Unavailable):
                raise
            raise L2Unavailable(f"L2 adapter {self.name} {op} failed: {exc!r}") from exc
        with self._lock:
            if self._degraded:
                self._degraded = False
                self._backoff = self._backoff_base
                logger.warning("L2 adapter %s recovered; using it again", self.name)
        return result

    def _mark_failed(self, op: str, exc: BaseException) -> None:
        with self._lock:
            was_degraded = self._degraded
            self.failures += 1
            self.last_error = f"{op}: {exc}"
            self._backoff = (
                min(self._backoff * 2, self._backoff_max) if was_degraded else self._backoff_base
            )
            self._degraded = True
            self._retry_at = self._clock() + self._backoff
            backoff = self._backoff
        if not isinstance(exc, L2Unavailable):
            logger.error(
                "L2 adapter %s raised an unexpected error in %s; treating it as unavailable "
                "and continuing L1-only for it, retry in %.1fs",
                self.name,
                op,
                backoff,
                exc_info=exc,
            )
        elif not was_degraded:
            logger.warning(
                "L2 adapter %s unavailable (%s: %s); continuing L1-only for it, retry in %.1fs",
                self.name,
                op,
                exc,
                backoff,
            )
        else:
            logger.info(
                "L2 adapter %s still unavailable (%s: %s); retry in %.1fs",
                self.name,
                op,
                exc,
                backoff,
            )

    # -- data operations ----------------------------------------------------

    def put_many(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> list[bool]:
        """Store objects; successful ones enter the index and are reported as STORE."""
        if not items:
            return []
        ok = self._call("put_many", lambda: _checked(self.adapter.put_many(items), len(items)))
        stored = [(key, view.nbytes) for (key, view), good in zip(items, ok, strict=True) if good]
        with self._lock:
            self.stored_keys += len(stored)
            self.store_failed_keys += len(items) - len(stored)
        if stored:
            with self._event_lock:
                self.index.add([k for k, _ in stored], [s for _, s in stored])
                self._record(EventType.STORE, stored)
        return ok

    def get_into(self, keys: Sequence[ObjectKey], outs: Sequence[memoryview]) -> list[bool]:
        """Load objects into L1 buffers; loaded keys are touched and reported as ACCESS."""
        if not keys:
            return []
        ok = self._call("get_into", lambda: _checked(self.adapter.get_into(keys, outs), len(keys)))
        loaded = [(key, out.nbytes) for key, out, good in zip(keys, outs, ok, strict=True) if good]
        with self._lock:
            self.loaded_keys += len(loaded)
            self.load_failed_keys += len(keys) - len(loaded)
        if loaded:
            with self._event_lock:
                self.index.touch([k for k, _ in loaded])
                self._record(EventType.ACCESS, loaded)
        return ok

    def surely_absent(self, key: ObjectKey) -> bool:
        """True when the adapter certainly does not hold ``key``, known without asking it.

        Only for an adapter that is the sole writer of its backend, once its
        index is complete (listed at start, kept since): a key the index lacks
        is then not there. False means "ask the adapter" (:meth:`contains`).
        """
        return (
            self.sole_writer and self.index_state == "complete" and self.index.size_of(key) is None
        )

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Per-key presence."""
        if not keys:
            return []
        return self._call("contains", lambda: _checked(self.adapter.contains(keys), len(keys)))

    def delete_many(self, keys: Sequence[ObjectKey]) -> int:
        """Delete objects; they leave the index and are reported as DELETE."""
        if not keys:
            return 0
        removed = self._call("delete_many", lambda: int(self.adapter.delete_many(keys)))
        with self._lock:
            self.deleted_keys += removed
        with self._event_lock:
            self.index.remove(keys)
            # Reported for every key asked: the adapter only returns a count, and
            # a DELETE of a key the coordinator does not place there is a no-op.
            self._record(EventType.DELETE, [(k, 0) for k in keys])
        return removed

    def refresh_capacity(self) -> int:
        """Ask the adapter for its declared capacity (0 = undeclared) and remember it."""
        usage = self._call("usage", self.adapter.usage)
        self.declared_capacity_bytes = max(0, int(usage.capacity_bytes))
        return self.declared_capacity_bytes

    def rebuild_index(self) -> int:
        """List everything the adapter holds into the index and announce it as STORE.

        Run at start so the coordinator learns this node's L2 placements after a
        restart. Returns the number of entries.
        """
        self.index_state = "building"
        count = 0
        batch: list[tuple[ObjectKey, int]] = []

        def flush() -> None:
            with self._event_lock:
                self.index.add([k for k, _ in batch], [s for _, s in batch])
                self._record(EventType.STORE, batch)
            batch.clear()

        def walk() -> int:
            nonlocal count
            for entry in self.adapter.iter_entries():
                batch.append((entry.key, entry.size_bytes))
                count += 1
                if len(batch) >= _INDEX_EVENT_BATCH:
                    flush()
            if batch:
                flush()
            return count

        try:
            self._call("iter_entries", walk)
        except L2Unavailable:
            self.index_state = "failed"
            raise
        self.index_state = "complete"
        logger.info(
            "L2 adapter %s holds %d objects (%d bytes)", self.name, count, self.index.total_bytes
        )
        return count

    def close(self) -> None:
        """Close the adapter; errors are logged, never raised."""
        try:
            self.adapter.close()
        except Exception:
            logger.exception("closing L2 adapter %s failed", self.name)

    # -- status -------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Health, index figures and counters."""
        with self._lock:
            degraded = self._degraded
            retry_in = max(0.0, self._retry_at - self._clock()) if degraded else 0.0
        return {
            "name": self.name,
            "backend": self.backend,
            "shared": self.shared,
            "healthy": not degraded,
            "degraded": degraded,
            "retry_in_s": retry_in,
            "last_error": self.last_error,
            "failures": self.failures,
            "rejected_calls": self.rejected_calls,
            "index_state": self.index_state,
            "index_objects": len(self.index),
            "index_bytes": self.index.total_bytes,
            "index_bytes_by_salt": self.index.bytes_by_salt(),
            "declared_capacity_bytes": self.declared_capacity_bytes,
            "stored_keys": self.stored_keys,
            "store_failed_keys": self.store_failed_keys,
            "loaded_keys": self.loaded_keys,
            "load_failed_keys": self.load_failed_keys,
            "deleted_keys": self.deleted_keys,
        }

    def _record(self, event_type: EventType, entries: Sequence[tuple[ObjectKey, int]]) -> None:
        if self._sink is None or not entries:
            return
        try:
            self._sink.record(event_type, Tier.L2, self.backend, self.shared, list(entries))
        except Exception:
            logger.exception("event sink rejected %s L2 events of %s", event_type.name, self.name)


def _checked(result: Sequence[bool], expected: int) -> list[bool]:
    """An adapter answer of the wrong length is garbage: treat the backend as unavailable."""
    out = [bool(x) for x in result]
    if len(out) != expected:
        raise L2Unavailable(f"adapter returned {len(out)} results for {expected} keys")
    return out


def make_tiers(
    adapters: Sequence[L2Adapter],
    sink: EventSink | None,
    *,
    backoff_s: float,
    max_backoff_s: float,
    clock: Callable[[], float],
) -> list[L2Tier]:
    """One tier per adapter, named after its backend (``disk``, ``disk#2``, ...)."""
    tiers: list[L2Tier] = []
    seen: dict[str, int] = {}
    for adapter in adapters:
        n = seen.get(adapter.backend, 0) + 1
        seen[adapter.backend] = n
        name = adapter.backend if n == 1 else f"{adapter.backend}#{n}"
        tiers.append(
            L2Tier(
                adapter,
                name=name,
                sink=sink,
                backoff_s=backoff_s,
                max_backoff_s=max_backoff_s,
                clock=clock,
            )
        )
    return tiers
