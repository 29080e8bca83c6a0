"""Builders and fakes shared by the coordinator core's unit tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, Tier
from kvmesh.common.keys import ObjectKey, worker_kv_rank

RANK0 = worker_kv_rank(1, 0)
MODEL = "m"


def h(i: int) -> bytes:
    """A 32-byte chunk hash that is distinct per ``i``."""
    return i.to_bytes(4, "big") * 8


def key(
    i: int, *, model: str = MODEL, rank: int = RANK0, group: int = 0, salt: str = ""
) -> ObjectKey:
    """Key number ``i`` in the given namespace."""
    return ObjectKey(h(i), model, rank, group, salt)


@dataclass
class Stream:
    """One emitter: stamps instance, incarnation and consecutive seqs."""

    instance_id: str = "node-a"
    incarnation: int = 1
    seq: int = 0

    def batch(
        self,
        event_type: EventType,
        tier: Tier,
        backend: str,
        entries: Sequence[CacheEventEntry] = (),
        *,
        shared: bool = False,
        ts: float = 0.0,
        seq: int | None = None,
        incarnation: int | None = None,
        capacity_bytes: int = 0,
        capacity_revision: int = 0,
    ) -> CacheEventBatch:
        """Next batch of this stream (or one with an explicit seq / incarnation)."""
        if seq is None:
            self.seq += 1
            seq = self.seq
        return CacheEventBatch(
            instance_id=self.instance_id,
            incarnation=self.incarnation if incarnation is None else incarnation,
            seq=seq,
            event_type=event_type,
            tier=tier,
            backend=backend,
            entries=tuple(entries),
            shared=shared,
            ts=ts,
            capacity_bytes=capacity_bytes,
            capacity_revision=capacity_revision,
        )

    def store(
        self,
        keys: Sequence[ObjectKey],
        *,
        tier: Tier = Tier.L1,
        backend: str | None = None,
        size: int = 1024,
        shared: bool = False,
        ts: float = 0.0,
        tokens: Sequence[int] = (),
        token_offset: int = -1,
        seq: int | None = None,
    ) -> CacheEventBatch:
        """A STORE batch of ``keys`` (each ``size`` bytes)."""
        return self.batch(
            EventType.STORE,
            tier,
            backend or _default_backend(tier),
            [CacheEventEntry(k, size, tokens, token_offset) for k in keys],
            shared=shared,
            ts=ts,
            seq=seq,
        )

    def delete(
        self,
        keys: Sequence[ObjectKey],
        *,
        tier: Tier = Tier.L1,
        backend: str | None = None,
        shared: bool = False,
        seq: int | None = None,
    ) -> CacheEventBatch:
        """A DELETE batch of ``keys``."""
        return self.batch(
            EventType.DELETE,
            tier,
            backend or _default_backend(tier),
            [CacheEventEntry(k) for k in keys],
            shared=shared,
            seq=seq,
        )

    def access(
        self,
        keys: Sequence[ObjectKey],
        *,
        tier: Tier = Tier.L1,
        backend: str = "",
        ts: float = 0.0,
        shared: bool = False,
    ) -> CacheEventBatch:
        """An ACCESS batch of ``keys``."""
        return self.batch(
            EventType.ACCESS,
            tier,
            backend,
            [CacheEventEntry(k) for k in keys],
            ts=ts,
            shared=shared,
        )

    def config(
        self,
        tier: Tier,
        backend: str,
        capacity_bytes: int,
        revision: int,
        *,
        shared: bool = False,
        incarnation: int | None = None,
    ) -> CacheEventBatch:
        """A CONFIG batch declaring one compartment."""
        return self.batch(
            EventType.CONFIG,
            tier,
            backend,
            shared=shared,
            capacity_bytes=capacity_bytes,
            capacity_revision=revision,
            incarnation=incarnation,
        )


def _default_backend(tier: Tier) -> str:
    return "dram" if tier == Tier.L1 else "fs"


@dataclass
class RecordingConsumer:
    """A consumer that remembers what it was given (optionally failing)."""

    name: str = "rec"
    log: list[tuple[str, str, object]] | None = None
    fail_consume: bool = False
    fail_fence: bool = False
    batches: list[CacheEventBatch] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)

    def consume(self, batch: CacheEventBatch) -> None:
        """Record (and maybe fail)."""
        if self.log is not None:
            self.log.append((self.name, "consume", batch.seq))
        if self.fail_consume:
            raise RuntimeError("boom")
        self.batches.append(batch)

    def fence_instance(self, instance_id: str) -> None:
        """Record (and maybe fail)."""
        if self.log is not None:
            self.log.append((self.name, "fence", instance_id))
        if self.fail_fence:
            raise RuntimeError("boom")
        self.fenced.append(instance_id)


class FakeClock:
    """A settable monotonic clock."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self.now += seconds


@dataclass
class RecordingDispatcher:
    """DeleteDispatcher that records calls and answers ``accept``."""

    accept: bool = True
    calls: list[tuple[str, Tier, str, tuple[ObjectKey, ...]]] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> bool:
        """Record the call."""
        self.calls.append((instance_id, tier, backend, tuple(keys)))
        self.forced.append(force)
        return self.accept
