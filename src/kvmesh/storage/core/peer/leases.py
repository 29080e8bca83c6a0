"""The serving side of P2P: read-locked prefixes leased to peers, streamed in frames.

A peer's ``LockPrefix`` runs this node's own lookup of the grid (L1 hits, and
hits in this node's own L2 adapters loaded into L1; never another peer:
``allow_peers=False``), so the prefix is read-locked exactly as a local
engine's lookup locks it, once per key. The locks are held by a *lease*
that ends, releasing every lock once, on the first of:

- the end of its ``ReadChunks`` stream (finished, failed, refused or
  cancelled by the peer: the generator's ``finally``, or the refusal of a
  bad frame size);
- ``Unlock``;
- its TTL (a timer on the event loop; the TTL is clamped to 0.8 of the L1
  read-lock TTL so the lease ends before the L1 locks could lapse, with room
  for a late timer).

Two kinds of stream read a lease (each lease is read once):

- ``read`` (gRPC's ReadChunks) checks its lease before every frame and
  copies a frame's bytes while the lease still holds the lock (all on the
  event loop, so an expiry cannot fall inside a copy). A stream whose lease
  expires stops with DEADLINE_EXCEEDED.
- ``open_stream`` / ``close_stream`` (the TCP data plane) hand out views of
  the chunks' L1 memory, which a sender thread writes to its socket without
  a copy. Such a stream must stop reading that memory by its ``deadline``
  (the lease's TTL, which ends before the L1 read locks could lapse), and an
  expiry while it is open does not release the locks under it: the release
  waits for ``close_stream``.

Either way a frame is never read from memory that was handed to another
object, and the peer keeps only the chunks it received whole.

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from kvmesh.common.keys import ObjectKey, validate_object_keys
from kvmesh.storage.core.node import LEASE_SHARE_OF_READ_TTL, StorageNode

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 30.0
MAX_LEASE_TTL_MS = 600_000
DEFAULT_FRAME_BYTES = 1024 * 1024
MAX_FRAME_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """What LockPrefix answers."""

    lease_id: str
    locked_chunks: int
    chunk_sizes: tuple[int, ...]
    ttl_s: float


@dataclass(eq=False)
class _Lease:
    lease_id: str
    requester: str
    keys: list[ObjectKey]  # column-major over the locked prefix
    sizes: list[int]
    deadline: float = 0.0  # time.monotonic() when the TTL ends
    timer: asyncio.TimerHandle | None = None
    reading: bool = False
    streaming: bool = False  # open_stream handed out its memory (close_stream frees it)
    ended: bool = False  # released, but a stream still reads its memory


@dataclass(frozen=True, slots=True)
class ChunkStream:
    """A lease's chunks as views of L1 memory, for one zero-copy stream."""

    lease_id: str
    #: Whole chunks in the lease's column-major order, up to the first one
    #: deleted by force since the lock.
    views: list[memoryview]
    #: ``time.monotonic()`` by which the stream stops reading ``views``.
    deadline: float


class PeerLeases:
    """Leases of read-locked prefixes granted to peers, and their streams."""

    def __init__(
        self,
        node: StorageNode,
        *,
        instance_id: str,
        incarnation: int,
        default_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        self.node = node
        self.instance_id = instance_id
        self.incarnation = incarnation
        self.default_ttl_s = default_ttl_s
        self._leases: dict[str, _Lease] = {}
        self._ids = itertools.count(1)
        # Counters.
        self.leases_granted = 0
        self.leases_expired = 0
        self.served_chunks = 0
        self.served_bytes = 0

    @property
    def max_ttl_s(self) -> float:
        """The share of the L1 read-lock TTL a lookup lease gets too (240 of 300 s).

        A lease must end before its locks could lapse; the margin covers a
        sender's last ``sendall`` running past its deadline and an event loop
        that runs the expiry timer late (a second's margin did not).
        """
        return LEASE_SHARE_OF_READ_TTL * float(self.node.manager.l1.read_ttl_s)

    async def lock(
        self,
        rows: Sequence[Sequence[ObjectKey]],
        *,
        ttl_ms: int,
        expected_incarnation: int,
        requester: str,
        wait_s: float,
    ) -> LeaseGrant:
        """Read-lock the prefix of ``rows`` held here; a lease on it (empty when none)."""
        self._check(rows, ttl_ms)
        if expected_incarnation and expected_incarnation != self.incarnation:
            raise FailedPrecondition(
                f"this node ({self.instance_id}) is incarnation {self.incarnation}, not "
                f"{expected_incarnation}: it restarted since the directory answered",
                reason="INCARNATION_MISMATCH",
                metadata={"incarnation": str(self.incarnation)},
            )
        ttl_s = min(ttl_ms / 1000.0 if ttl_ms else self.default_ttl_s, self.max_ttl_s)
        # The lease's clock starts before the lookup: the L1 hits are locked at its
        # start, and an L2 load may take a while before it returns.
        started = time.monotonic()
        wait_ms = max(1, int(wait_s * 1000))
        state = await self.node.lookup_and_lock(
            f"peer:{requester or '?'}", rows, 1, wait_ms, allow_peers=False, leased=False
        )
        if not state.completed:
            # Too slow for the caller: give the locks back as soon as the load ends.
            self.node.release_prefetch(state.prefetch_id)
            return LeaseGrant("", 0, (), ttl_s)
        hit = state.hit_chunks
        keys = [row[c] for c in range(hit) for row in rows]
        sizes: list[int] = []
        for key in keys:
            size = self.node.manager.l1.size_of(key)
            if size is None:
                break
            sizes.append(size)
        height = len(rows)
        usable = len(sizes) // height
        if usable < hit:
            # A forced delete raced the lookup: serve the columns still here.
            self.node.manager.finish_read(keys[usable * height :], 1)
            keys = keys[: usable * height]
            sizes = sizes[: usable * height]
        if not keys:
            return LeaseGrant("", 0, (), ttl_s)
        lease_id = f"lease-{next(self._ids)}-{uuid.uuid4().hex[:12]}"
        lease = _Lease(lease_id, requester, keys, sizes, started + ttl_s)
        lease.timer = asyncio.get_running_loop().call_later(
            max(0.0, lease.deadline - time.monotonic()), self._expire, lease_id
        )
        self._leases[lease_id] = lease
        self.leases_granted += 1
        return LeaseGrant(lease_id, usable, tuple(sizes), ttl_s)

    async def read(
        self, lease_id: str, frame_bytes: int
    ) -> AsyncGenerator[tuple[int, int, bytes], None]:
        """The lease's chunks as ``(chunk_index, offset, data)`` frames; ends the lease.

        A refused stream ends its lease too (a frame size beyond the limit): the
        caller has no stream to read it with, so its locks are released now, not
        at the TTL. A lease another stream is reading is never touched.
        """
        lease = self._leases.get(lease_id)
        if frame_bytes > MAX_FRAME_BYTES:
            if lease is not None and not lease.reading:
                self.release(lease_id)
            raise InvalidArgument(
                f"max_frame_bytes must be <= {MAX_FRAME_BYTES}", field="max_frame_bytes"
            )
        frame = frame_bytes or DEFAULT_FRAME_BYTES
        if lease is None or lease.reading:
            raise NotFound(
                f"lease {lease_id!r} is unknown, expired, released or already read",
                reason="LEASE_NOT_FOUND",
            )
        lease.reading = True
        try:
            _, objects = self.node.manager.l1.unsafe_read(lease.keys)
            for index, (key, size) in enumerate(zip(lease.keys, lease.sizes, strict=True)):
                obj = objects.get(key)
                if obj is None:
                    return  # deleted by force meanwhile: the peer keeps what came whole
                view = obj.view()
                for offset in range(0, size, frame):
                    if lease_id not in self._leases:
                        raise DeadlineExceeded(
                            f"lease {lease_id} expired during its stream", reason="LEASE_EXPIRED"
                        )
                    data = bytes(view[offset : min(size, offset + frame)])
                    self.served_bytes += len(data)
                    yield index, offset, data
                self.served_chunks += 1
        finally:
            self.release(lease_id)

    def open_stream(self, lease_id: str) -> ChunkStream:
        """Hand a lease's chunk memory to one zero-copy stream (NOT_FOUND: unknown or read).

        The locks stay held until :meth:`close_stream`, whatever happens to
        the lease meanwhile (Unlock, TTL): the stream's sender may still be
        reading the memory, until its ``deadline`` at the latest.
        """
        lease = self._leases.get(lease_id)
        if lease is None or lease.reading:
            raise NotFound(
                f"lease {lease_id!r} is unknown, expired, released or already read",
                reason="LEASE_NOT_FOUND",
            )
        lease.reading = lease.streaming = True
        _, objects = self.node.manager.l1.unsafe_read(lease.keys)
        views: list[memoryview] = []
        for key, size in zip(lease.keys, lease.sizes, strict=True):
            obj = objects.get(key)
            if obj is None:
                break  # deleted by force meanwhile: the peer keeps what came whole
            views.append(obj.view()[:size])
        return ChunkStream(lease_id, views, lease.deadline)

    def close_stream(self, stream: ChunkStream, sent_chunks: int, sent_bytes: int) -> None:
        """The stream no longer reads its memory: count what it sent, end the lease."""
        self.served_chunks += sent_chunks
        self.served_bytes += sent_bytes
        lease = self._leases.get(stream.lease_id)
        if lease is not None:
            self._free(lease)

    def release(self, lease_id: str) -> bool:
        """End a lease: release its locks once. False when it was not alive."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.ended:
            return False
        lease.ended = True
        if not lease.streaming:  # else a sender still reads the memory: close_stream frees it
            self._free(lease)
        return True

    def _free(self, lease: _Lease) -> None:
        """Forget a lease and release its locks (once)."""
        if lease.timer is not None:
            lease.timer.cancel()
            lease.timer = None
        if self._leases.pop(lease.lease_id, None) is not None:
            self.node.manager.finish_read(lease.keys, 1)

    def _expire(self, lease_id: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.ended:
            return
        logger.info("P2P lease %s of %s expired; releasing its locks", lease_id, lease.requester)
        self.leases_expired += 1
        lease.timer = None
        self.release(lease_id)

    def close(self) -> None:
        """Release every lease (shutdown, after the data plane's senders stopped)."""
        for lease in list(self._leases.values()):
            self._free(lease)

    def _check(self, rows: Sequence[Sequence[ObjectKey]], ttl_ms: int) -> None:
        if not rows:
            raise InvalidArgument("the key grid has no kv_ranks", field="keys.kv_ranks")
        width = len(rows[0])
        if width == 0:
            raise InvalidArgument("the key grid has no chunk_hashes", field="keys.chunk_hashes")
        if width > self.node.max_chunks or width * len(rows) > self.node.max_chunks * 8:
            raise InvalidArgument("the key grid is too large", field="keys")
        if not rows[0][0].model_name:
            raise InvalidArgument("keys.model_name must not be empty", field="keys.model_name")
        for r, row in enumerate(rows):
            validate_object_keys(row, f"keys.rows[{r}]")
        if len({row[0].kv_rank for row in rows}) != len(rows):
            raise InvalidArgument("keys.kv_ranks must be distinct", field="keys.kv_ranks")
        if ttl_ms > MAX_LEASE_TTL_MS:
            raise InvalidArgument(
                f"lease_ttl_ms must be <= {MAX_LEASE_TTL_MS}", field="lease_ttl_ms"
            )

    def stats(self) -> dict[str, Any]:
        """Counters of the serving side."""
        return {
            "leases_granted": self.leases_granted,
            "leases_expired": self.leases_expired,
            "served_chunks": self.served_chunks,
            "served_bytes": self.served_bytes,
            "active_leases": sum(1 for lease in self._leases.values() if not lease.ended),
        }
