"""Prefetch ids: a lookup's prefetch under an id, its waits, and its abandonment.

A LookupAndLock starts a prefetch on the
:class:`~kvmesh.storage.core.controllers.prefetch.PrefetchController` and
names it with a prefetch id; its completed result is delivered once, then the
id is forgotten. A wait for a prefetch (``wait_ms``) parks no thread: it
awaits an asyncio future that the controller's done callback resolves from
its worker through ``loop.call_soon_threadsafe``, so any number of parked
waits never delays a store or a retrieve. An abandoned prefetch (released, or
its lookup's caller gone) gives its locks back from a done callback too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.common.errors import NotFound
from kvmesh.common.node_types import PrefetchState
from kvmesh.storage.core.controllers.prefetch_job import PrefetchHandle
from kvmesh.storage.core.controllers.prefetch_types import PrefetchResult
from kvmesh.storage.core.manager import StorageManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Prefetch:
    handle: PrefetchHandle
    # Resolved on the event loop when the prefetch finishes; made by its first waiter.
    done: asyncio.Future[None] | None = None


class PrefetchIds:
    """The node's prefetches by id (the table is thread-safe; waits run on the event loop).

    ``new_id(prefix)`` names a prefetch (unique on the node).
    """

    def __init__(
        self,
        manager: StorageManager,
        *,
        new_id: Callable[[str], str],
        on_complete: Callable[[str, PrefetchResult], None] | None = None,
    ) -> None:
        """``on_complete(id, result)`` runs (on the loop) as a result is delivered."""
        self.manager = manager
        self._new_id = new_id
        self._on_complete = on_complete
        self._prefetches: dict[str, _Prefetch] = {}
        self._lock = threading.Lock()
        self.waiting = 0  # prefetch waits parked right now (loop thread only)

    def __len__(self) -> int:
        """Prefetches whose result has not been delivered (or released) yet."""
        with self._lock:
            return len(self._prefetches)

    def add(self, handle: PrefetchHandle) -> str:
        """Name a submitted prefetch; returns its new id."""
        prefetch_id = self._new_id("prefetch")
        with self._lock:
            self._prefetches[prefetch_id] = _Prefetch(handle)
        return prefetch_id

    async def status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        """Status of a prefetch; a completed result is delivered once, then forgotten."""
        with self._lock:
            entry = self._prefetches.get(prefetch_id)
        if entry is None:
            raise NotFound(
                f"unknown prefetch {prefetch_id!r} (never started, delivered or released)",
                reason="UNKNOWN_PREFETCH",
            )
        result = self.manager.query_prefetch(entry.handle)
        if result is None and wait_ms > 0:
            await self._wait_done(entry, wait_ms / 1000.0)
            result = self.manager.query_prefetch(entry.handle)
        if result is None:
            return PrefetchState(prefetch_id, False)
        with self._lock:
            delivered = self._prefetches.pop(prefetch_id, None) is not None
        if delivered and self._on_complete is not None:
            self._on_complete(prefetch_id, result)
        return _finished(prefetch_id, result)

    async def _wait_done(self, entry: _Prefetch, timeout: float) -> None:
        """Wait until the prefetch finishes or ``timeout`` seconds pass, parking no thread."""
        loop = asyncio.get_running_loop()
        if entry.done is None or entry.done.get_loop() is not loop:
            done: asyncio.Future[None] = loop.create_future()
            self.manager.prefetch.add_done_callback(
                entry.handle, functools.partial(_resolve_threadsafe, loop, done)
            )
            entry.done = done
        self.waiting += 1
        try:
            # Shielded: a waiter that times out or goes away leaves the future to the others.
            await asyncio.wait_for(asyncio.shield(entry.done), timeout)
        except TimeoutError:
            pass
        finally:
            self.waiting -= 1

    def release(self, prefetch_id: str) -> bool:
        """Abandon a prefetch: its locks are released as soon as it finishes (now if it has)."""
        with self._lock:
            entry = self._prefetches.pop(prefetch_id, None)
        if entry is None:
            return False
        # NotFound: its result expired unqueried, and the controller released its locks
        # then (or dropped them, had they lapsed).
        with contextlib.suppress(NotFound):
            self.manager.prefetch.add_done_callback(entry.handle, self._release_abandoned)
        return True

    def _release_abandoned(self, handle: PrefetchHandle) -> None:
        """Done callback of an abandoned prefetch (its worker's thread): give the locks back."""
        try:
            result = self.manager.query_prefetch(handle)
        except NotFound:
            return  # expired meanwhile (its locks went with the controller's sweep)
        if result is None or not result.locked_keys:
            return
        if self.manager.l1.lapsed(result.started):
            # It ran past the read TTL: its first locks lapsed, and their counts may be
            # newer readers' now (the rest lapse on their own).
            logger.warning(
                "abandoned prefetch of %r finished after the read TTL; its %d locks are "
                "dropped, not released",
                result.request_id,
                len(result.locked_keys),
            )
            return
        self.manager.finish_read(result.locked_keys, result.num_kv_readers)

    def forget_expired(self) -> list[str]:
        """Forget prefetch ids whose result expired unqueried (the controller's sweep took
        their locks)."""
        self.manager.prefetch.sweep()
        with self._lock:
            entries = list(self._prefetches.items())
        gone = [pid for pid, e in entries if not self.manager.prefetch.known(e.handle)]
        if gone:
            with self._lock:
                for pid in gone:
                    self._prefetches.pop(pid, None)
            logger.info("forgot %d prefetches whose results expired unqueried", len(gone))
        return gone


def _finished(prefetch_id: str, result: PrefetchResult) -> PrefetchState:
    rows = max(result.num_rows, 1)
    l2_chunks = -(-result.l2_hit_cells // rows) if result.l2_hit_cells else 0
    return PrefetchState(
        prefetch_id,
        True,
        result.hit_chunks,
        max(result.hit_chunks - l2_chunks, 0),
        min(l2_chunks, result.hit_chunks),
    )


def _resolve_threadsafe(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], _handle: PrefetchHandle
) -> None:
    """A prefetch's done callback (on its worker): resolve ``future`` on its own loop."""
    # RuntimeError: the loop is closed, so nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_set_done, future)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
