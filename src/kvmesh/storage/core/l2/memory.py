"""An in-process L2 adapter, and the small argument helpers every adapter shares.

:class:`MemoryL2Adapter` is the reference implementation of the
:class:`~kvmesh.storage.core.l2.base.L2Adapter` contract: a dict behind a lock.
It exists for controller tests, so it can pretend to be a slow or broken
backend: a fixed per-call latency, a bandwidth limit (the call sleeps for
``bytes / bandwidth``) and a "down" switch that makes every call raise
:class:`L2Unavailable`. Several adapters may share one :class:`MemoryL2Pool`
to model a pool that several storage nodes mount.

"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l2.base import (
    L2Entry,
    L2Unavailable,
    L2Usage,
    check_get_args,
    check_put_items,
)

logger = logging.getLogger(__name__)


class MemoryL2Pool:
    """The objects of one in-memory backend; share one between adapters to model a shared pool."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[ObjectKey, bytes] = {}
        self.used_bytes = 0


class MemoryL2Adapter:
    """Objects held in a dict, with injectable latency, bandwidth and outages.

    ``capacity_bytes`` > 0 makes a put that would exceed it fail (per item,
    returns False) instead of evicting: eviction is the controllers' job.
    Closing an adapter drops its objects unless ``pool`` was passed in, in
    which case the pool (and whoever else holds it) keeps them.
    """

    backend = "memory"

    def __init__(
        self,
        *,
        capacity_bytes: int = 0,
        latency_s: float = 0.0,
        bandwidth_bytes_per_s: float = 0.0,
        pool: MemoryL2Pool | None = None,
        shared: bool = False,
    ) -> None:
        if capacity_bytes < 0:
            raise InvalidArgument("capacity_bytes must be >= 0", field="capacity_bytes")
        if latency_s < 0:
            raise InvalidArgument("latency_s must be >= 0", field="latency_s")
        if bandwidth_bytes_per_s < 0:
            raise InvalidArgument(
                "bandwidth_bytes_per_s must be >= 0", field="bandwidth_bytes_per_s"
            )
        self.shared = shared
        self.capacity_bytes = capacity_bytes
        #: Seconds every call sleeps before doing its work (0 = none).
        self.latency_s = latency_s
        #: Simulated transfer rate for payload bytes (0 = unlimited).
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._owns_pool = pool is None
        self._pool = pool if pool is not None else MemoryL2Pool()
        self._down = False
        self._closed = False

    # -- fault injection -------------------------------------------------------------------

    @property
    def down(self) -> bool:
        """True while the adapter pretends its backend is unreachable."""
        return self._down

    def set_down(self, down: bool) -> None:
        """Switch the simulated outage on or off; objects survive an outage."""
        self._down = down

    def _enter(self) -> None:
        if self._closed:
            raise L2Unavailable("memory L2 adapter is closed", reason="L2_CLOSED")
        if self._down:
            raise L2Unavailable("memory L2 backend is down (injected)")
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def _transfer(self, nbytes: int) -> None:
        if self.bandwidth_bytes_per_s > 0 and nbytes > 0:
            time.sleep(nbytes / self.bandwidth_bytes_per_s)

    # -- the L2Adapter contract ------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> list[bool]:
        """Copy each payload into the pool; False for items that do not fit the capacity."""
        views = check_put_items(items)
        self._enter()
        self._transfer(sum(v.nbytes for v in views))
        results: list[bool] = []
        pool = self._pool
        for (key, _), view in zip(items, views, strict=True):
            data = view.tobytes()
            with pool.lock:
                old = pool.objects.get(key)
                grow = len(data) - (len(old) if old is not None else 0)
                if self.capacity_bytes and pool.used_bytes + grow > self.capacity_bytes:
                    results.append(False)
                    continue
                pool.objects[key] = data
                pool.used_bytes += grow
            results.append(True)
        return results

    def get_into(self, keys: Sequence[ObjectKey], outs: Sequence[memoryview]) -> list[bool]:
        """Copy each stored object into its buffer when the sizes match exactly."""
        views = check_get_args(keys, outs)
        self._enter()
        found: list[bytes | None] = []
        with self._pool.lock:
            for key in keys:
                found.append(self._pool.objects.get(key))
        results: list[bool] = []
        moved = 0
        for data, view in zip(found, views, strict=True):
            if data is None or len(data) != view.nbytes:
                results.append(False)
                continue
            view[:] = data
            moved += len(data)
            results.append(True)
        self._transfer(moved)
        return results

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Per-key presence."""
        self._enter()
        with self._pool.lock:
            return [key in self._pool.objects for key in keys]

    def delete_many(self, keys: Sequence[ObjectKey]) -> int:
        """Remove the keys that exist; returns how many were removed."""
        self._enter()
        removed = 0
        with self._pool.lock:
            for key in keys:
                data = self._pool.objects.pop(key, None)
                if data is not None:
                    self._pool.used_bytes -= len(data)
                    removed += 1
        return removed

    def iter_entries(self) -> Iterator[L2Entry]:
        """A snapshot of every stored object."""
        self._enter()
        with self._pool.lock:
            snapshot = [L2Entry(key, len(data)) for key, data in self._pool.objects.items()]
        return iter(snapshot)

    def usage(self) -> L2Usage:
        """Bytes and objects in the pool, and the declared capacity."""
        self._enter()
        with self._pool.lock:
            return L2Usage(
                used_bytes=self._pool.used_bytes,
                capacity_bytes=self.capacity_bytes,
                object_count=len(self._pool.objects),
            )

    def close(self) -> None:
        """Drop the objects of a private pool; a shared pool is left to its other holders."""
        if self._closed:
            return
        self._closed = True
        if self._owns_pool:
            with self._pool.lock:
                self._pool.objects.clear()
                self._pool.used_bytes = 0
