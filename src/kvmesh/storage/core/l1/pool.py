"""The L1 memory pool: shared-memory segments grown lazily up to a configured size.

Each segment is a file ``kvmesh-l1-<instance>-<n>`` under the shm directory
(``/dev/shm`` by default), mapped read-write, so an engine-driven client can
map the same bytes from ``L1Object.location()``. Segments are added as the
pool fills: a background thread grows ahead once usage of what is committed
passes a watermark, or less is free than half a segment or the largest
reservation a store asked for (``expect_reservation``), so the request path
rarely pays for it; an allocation that still does not fit grows
synchronously (``grow_for``).

Every new segment is backed and pre-faulted before it is used:
``posix_fallocate`` reserves the tmpfs pages (a full ``/dev/shm`` is an
error at growth, not a SIGBUS in the middle of a copy later) and
``MADV_POPULATE_WRITE`` (or a write to every page where that is missing)
maps them, because the first touch of a fresh page is 5-30x slower than a
warm copy on these machines. Every step of a growth (``posix_fallocate``,
``mmap``, the populate through ctypes) runs with the GIL released, and on the
grower's thread or a worker thread, never on an event loop.

A lock file ``kvmesh-l1-<instance>.lock`` (``flock``) guards the instance
name: segments left behind by a dead process of the same name are removed
at start, while a live one makes the new pool refuse to start instead of
deleting memory in use.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmesh.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvmesh.common.pages import populate
from kvmesh.common.thread_priority import lower_this_thread
from kvmesh.storage.core.l1.allocator import ExtentAllocator
from kvmesh.storage.core.l1.objects import ALIGNMENT, L1Object, Segment, align_up

logger = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_SEGMENT_BYTES = 256 * MIB
DEFAULT_SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")
# After a failed growth (e.g. /dev/shm full) wait this long before trying again.
_GROW_RETRY_S = 10.0


def segment_prefix(instance_name: str) -> str:
    """File-name prefix of one node's segments (instance name made file-name safe)."""
    return f"kvmesh-l1-{_SAFE_NAME.sub('_', instance_name)}"


class L1Pool:
    """CPU memory for L1 objects, in shared-memory segments that grow on demand.

    ``capacity_bytes`` is the configured size (rounded up to the alignment);
    ``committed_bytes`` is what has been mapped so far. Thread-safe.
    """

    def __init__(
        self,
        instance_name: str,
        capacity_bytes: int,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        shm_dir: str = DEFAULT_SHM_DIR,
        initial_bytes: int | None = None,
        grow_watermark: float = 0.75,
        prefault: bool = True,
        background_grow: bool = True,
        full_chunk_bytes: int | None = None,
    ) -> None:
        if not instance_name:
            raise InvalidArgument("instance_name must not be empty", field="instance_name")
        if capacity_bytes <= 0:
            raise InvalidArgument("L1 capacity must be > 0 bytes", field="capacity_bytes")
        if segment_bytes <= 0:
            raise InvalidArgument("L1 segment size must be > 0 bytes", field="segment_bytes")
        if not 0.0 < grow_watermark <= 1.0:
            raise InvalidArgument("grow_watermark must be in (0, 1]", field="grow_watermark")
        self.capacity_bytes = align_up(capacity_bytes)
        self.segment_bytes = min(align_up(segment_bytes), self.capacity_bytes)
        self.shm_dir = shm_dir
        self.prefault = prefault
        self.grow_watermark = grow_watermark
        self.prefix = segment_prefix(instance_name)

        self._lock = threading.Lock()
        self._grown = threading.Condition(self._lock)
        self._grow_lock = threading.Lock()
        self._grow_forced = False  # request_growth: one segment even below the watermark
        self._largest_reservation = 0  # expect_reservation: kept free ahead of the stores
        # Objects this large pack from the bottom, smaller ones from the top
        # (see allocator); None learns it as the largest size seen.
        self._alloc = ExtentAllocator(ALIGNMENT, large_bytes=full_chunk_bytes)
        self._segments: list[Segment] = []
        self._committed = 0
        self._closed = False
        self._grow_blocked_until = 0.0
        self.grow_failures = 0
        self.last_grow_error = ""
        self.allocation_failures = 0

        os.makedirs(shm_dir, exist_ok=True)
        reclaim_dead_pools(shm_dir)
        self._lock_fd = self._acquire_name_lock()
        try:
            self._remove_stale_segments()
            initial = self.segment_bytes if initial_bytes is None else initial_bytes
            initial = min(max(initial, 0), self.capacity_bytes)
            while self._committed < initial:
                if not self._grow_one():
                    raise ResourceExhausted(
                        f"cannot map the initial {initial} bytes of L1 under {shm_dir}: "
                        f"{self.last_grow_error}"
                    )
        except BaseException:
            self._release_files()
            raise

        self._closing = threading.Event()
        self._grow_wanted = threading.Event()
        self._grower: threading.Thread | None = None
        if background_grow and self._committed < self.capacity_bytes:
            self._grower = threading.Thread(
                target=self._grow_loop, name=f"{self.prefix}-grow", daemon=True
            )
            self._grower.start()

    # -- allocation -------------------------------------------------------

    @property
    def max_object_bytes(self) -> int:
        """Largest object the pool can ever hold (one segment)."""
        return self.segment_bytes

    def allocate(self, nbytes: int) -> L1Object | None:
        """Reserve an object of exactly ``nbytes`` bytes; None when nothing fits right now.

        Never grows synchronously (the caller decides whether to ``grow_for``
        or evict); it wakes the background grower when usage passes the
        watermark.
        """
        if nbytes <= 0 or nbytes > self.segment_bytes:
            raise InvalidArgument(
                f"L1 object size {nbytes} must be in [1, {self.segment_bytes}] "
                "(the L1 segment size)",
                field="nbytes",
            )
        with self._lock:
            if self._closed:
                raise FailedPrecondition("the L1 pool is closed")
            placed = self._alloc.allocate(nbytes)
            if placed is None:
                self.allocation_failures += 1
            wake = self._wants_growth_locked()
        if wake:
            self._grow_wanted.set()
        if placed is None:
            return None
        segment, offset, capacity = placed
        return L1Object(self._segments[segment], offset, nbytes, capacity)

    def free(self, obj: L1Object) -> None:
        """Give an object's memory back. Freeing twice is logged and ignored."""
        with self._lock:
            if obj.released:
                logger.error("double free of %r ignored", obj)
                return
            obj.mark_released()
            if self._closed:
                return
            self._alloc.free(obj.segment.index, obj.offset)

    def would_fit(self, sizes: Sequence[int]) -> bool:
        """Whether all ``sizes`` could be allocated at once from what is committed."""
        with self._lock:
            return self._alloc.would_fit(sizes)

    def can_grow(self) -> bool:
        """Whether a growth may add memory now (below capacity, not backing off a failure)."""
        with self._lock:
            below = not self._closed and self._committed < self.capacity_bytes
        return below and time.monotonic() >= self._grow_blocked_until

    def expect_reservation(self, sizes: Sequence[int]) -> None:
        """A store is about to reserve objects of ``sizes`` at once: from now on the
        grower keeps the largest such reservation free ahead (up to capacity), so
        the next store of that size finds room instead of waiting for a growth."""
        nbytes = min(sum(align_up(size) for size in sizes), self.capacity_bytes)
        with self._lock:
            self._largest_reservation = max(self._largest_reservation, nbytes)

    def request_growth(self) -> None:
        """Ask the background grower for one more segment (returns at once)."""
        with self._lock:
            self._grow_forced = True
        self._grow_wanted.set()

    def grow_for(self, sizes: Sequence[int]) -> bool:
        """Grow synchronously until ``sizes`` fit or the pool is at capacity; True when they fit.

        It maps and populates segments on the calling thread (tens of ms per
        256 MiB): never call it on an event loop (see
        :meth:`kvmesh.storage.core.manager.StorageManager.make_room`).
        """
        while True:
            if self.would_fit(sizes):
                return True
            if not self._grow_one():
                return self.would_fit(sizes)

    # -- introspection ----------------------------------------------------

    @property
    def committed_bytes(self) -> int:
        """Bytes mapped so far (<= capacity)."""
        with self._lock:
            return self._committed

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live objects (aligned sizes)."""
        with self._lock:
            return self._alloc.used_bytes

    @property
    def free_bytes(self) -> int:
        """Committed bytes not reserved by live objects (possibly not contiguous)."""
        with self._lock:
            return self._alloc.free_bytes

    def wait_committed(self, nbytes: int, timeout: float) -> bool:
        """Wait until at least ``nbytes`` are committed; False on timeout."""
        with self._grown:
            return self._grown.wait_for(lambda: self._committed >= nbytes, timeout)

    def segment_paths(self) -> list[str]:
        """Paths of the segment files, in segment order."""
        with self._lock:
            return [s.path for s in self._segments]

    def stats(self) -> dict[str, Any]:
        """Plain figures for status and metrics."""
        with self._lock:
            return {
                "capacity_bytes": self.capacity_bytes,
                "committed_bytes": self._committed,
                "used_bytes": self._alloc.used_bytes,
                "free_committed_bytes": self._alloc.free_bytes,
                "largest_free_extent_bytes": self._alloc.largest_free_extent,
                "free_extents": self._alloc.free_extent_count,
                "segments": len(self._segments),
                "segment_bytes": self.segment_bytes,
                "allocation_failures": self.allocation_failures,
                "grow_failures": self.grow_failures,
                "last_grow_error": self.last_grow_error,
            }

    # -- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Stop the grower, unmap and remove every segment file. Idempotent."""
        if hasattr(self, "_closing"):
            self._closing.set()
            self._grow_wanted.set()
            if self._grower is not None:
                self._grower.join()
        with self._grow_lock, self._lock:
            if self._closed:
                return
            self._closed = True
        self._release_files()

    def __enter__(self) -> L1Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------

    def _wants_growth_locked(self) -> bool:
        """Usage passed the watermark, or less is left free than the headroom: half a
        segment, or the largest reservation a store asked for if that is more.

        The headroom rule keeps a growth ahead of the stores: on a VM a new
        segment's first touch can take most of a second (fresh guest memory),
        and with 256 MiB segments a 75 % watermark leaves 64 MiB, which a
        busy node stores in about that time. A store that finds no room waits
        for the growth, and vLLM's blocks wait with it. One long prompt of a
        real model can need more than half a segment (8 000 tokens of
        SmolLM2 are 174 MiB), or several segments for larger models.
        """
        if self._committed >= self.capacity_bytes:
            return False
        used = self._alloc.used_bytes
        headroom = max(
            min(self.segment_bytes // 2, self._committed // 2), self._largest_reservation
        )
        return used >= self.grow_watermark * self._committed or (self._committed - used < headroom)

    def _grow_loop(self) -> None:
        # Growth is background work: a store waits for it only when L1 is full, and
        # the headroom rule starts it well before. At the default priority, mapping
        # a segment took the node's one free core from its own event loop on a 2-core
        # host (docs/architecture.md, "Background work runs at a lower priority").
        lower_this_thread()
        while not self._closing.is_set():
            self._grow_wanted.wait()
            self._grow_wanted.clear()
            while not self._closing.is_set():
                with self._lock:
                    wanted = self._grow_forced or self._wants_growth_locked()
                    self._grow_forced = False
                if not wanted or not self._grow_one():
                    break

    def _grow_one(self) -> bool:
        """Map one more segment; False when at capacity, closed, or the system refused."""
        with self._grow_lock:
            with self._lock:
                if self._closed or self._committed >= self.capacity_bytes:
                    return False
                index = len(self._segments)
                size = min(self.segment_bytes, self.capacity_bytes - self._committed)
            # Growth throttling only; never affects correctness, so no injected clock.
            now = time.monotonic()
            if now < self._grow_blocked_until:
                return False
            path = os.path.join(self.shm_dir, f"{self.prefix}-{index}")
            try:
                segment = self._map_segment(index, path, size)
            except OSError as exc:
                self.grow_failures += 1
                self.last_grow_error = f"{path}: {exc}"
                self._grow_blocked_until = now + _GROW_RETRY_S
                logger.error(
                    "L1 pool cannot grow to %d bytes (%s); staying at the current size",
                    self._committed + size,
                    self.last_grow_error,
                )
                return False
            with self._lock:
                self._segments.append(segment)
                self._alloc.add_segment(index, size)
                self._committed += size
                self._grown.notify_all()
            logger.info(
                "L1 pool grew to %d of %d bytes in %.0f ms (segment %s)",
                self._committed,
                self.capacity_bytes,
                (time.monotonic() - now) * 1e3,
                path,
            )
            return True

    def _map_segment(self, index: int, path: str, size: int) -> Segment:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Reserve the tmpfs pages now: a full /dev/shm must fail here,
                # not as SIGBUS on a later write.
                os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        if self.prefault:
            _prefault(mapping)
        return Segment(index, path, size, mapping)

    def _acquire_name_lock(self) -> int:
        lock_path = os.path.join(self.shm_dir, f"{self.prefix}.lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FailedPrecondition(
                    f"another live process holds the L1 pool {self.prefix} in {self.shm_dir}; "
                    "instance names must be unique per host"
                ) from exc
            raise
        # The owner's pid, for operators; liveness itself is the flock (it dies with us).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        return fd

    def _remove_stale_segments(self) -> None:
        pattern = re.compile(re.escape(self.prefix) + r"-(\d+)$")
        for name in os.listdir(self.shm_dir):
            if pattern.match(name):
                path = os.path.join(self.shm_dir, name)
                logger.warning("removing stale L1 segment %s left by an earlier process", path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _release_files(self) -> None:
        for segment in self._segments:
            segment.release()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path)
        lock_path = os.path.join(self.shm_dir, f"{self.prefix}.lock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


_LOCK_SUFFIX = ".lock"


def reclaim_dead_pools(shm_dir: str) -> list[str]:
    """Remove the segments and lock files of L1 pools whose owner process is dead.

    A pool's owner holds ``flock`` on its lock file for as long as it lives
    (a SIGKILL releases it), so a lock file this process can lock belongs to
    a dead owner: its segments are memory nobody will ever free. Pools of
    live processes are left alone. Returns the removed paths.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith("kvmesh-l1-") and name.endswith(_LOCK_SUFFIX)):
            continue
        lock_path = os.path.join(shm_dir, name)
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live owner
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            prefix = name[: -len(_LOCK_SUFFIX)]
            before = len(removed)
            pattern = re.compile(re.escape(prefix) + r"-(\d+)$")
            for other in names:
                if pattern.match(other):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(shm_dir, other))
                        removed.append(os.path.join(shm_dir, other))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
                removed.append(lock_path)
            logger.warning(
                "reclaimed the L1 pool %s of dead process %s (%d files)",
                prefix,
                owner,
                len(removed) - before,
            )
        finally:
            os.close(fd)
    return removed


def _prefault(mapping: mmap.mmap) -> None:
    """Write-fault every page of a fresh mapping so first copies run at warm speed.

    Through :func:`kvmesh.common.pages.populate` (ctypes), which lets go of the
    GIL: populating a 256 MiB segment takes about 75 ms here, and
    ``mmap.madvise`` would hold the GIL for all of it, stopping every other
    thread of the process (the event loop answering lookups among them).
    """
    view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    address = ctypes.addressof(view)
    del view  # the mapping can be closed again once no buffer of it is exported
    if populate(address, len(mapping)):
        return
    # Older kernel: touch one byte per page by hand (a write, so the page is
    # really allocated, not mapped to the shared zero page).
    pages = np.frombuffer(mapping, dtype=np.uint8)
    pages[::_PAGE] = 0
    del pages
