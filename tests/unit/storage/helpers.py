"""Helpers for the storage core tests: a fake clock, keys, a fake L2, recorders."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l2.base import L2Entry, L2Unavailable, L2Usage

MIB = 1 << 20


def make_key(i: int, *, salt: str = "", rank: int = 0, model: str = "m") -> ObjectKey:
    """A valid key whose hash is derived from ``i`` (stable across calls)."""
    return ObjectKey(
        chunk_hash=hashlib.sha256(f"chunk-{i}".encode()).digest(),
        model_name=model,
        kv_rank=rank,
        cache_salt=salt,
    )


class FakeClock:
    """Manually advanced monotonic clock."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RecordingSink:
    """EventSink that keeps every record in order."""

    events: list[tuple[EventType, Tier, str, bool, list[tuple[ObjectKey, int]]]] = field(
        default_factory=list
    )
    capacities: list[list[tuple[Tier, str, int, bool]]] = field(default_factory=list)
    lock: threading.Condition = field(default_factory=threading.Condition)

    def record(
        self,
        event_type: EventType,
        tier: Tier,
        backend: str,
        shared: bool,
        entries: Sequence[tuple[ObjectKey, int]],
    ) -> None:
        with self.lock:
            self.events.append((event_type, tier, backend, shared, list(entries)))
            self.lock.notify_all()

    def record_capacity(self, modules: Sequence[tuple[Tier, str, int, bool]]) -> None:
        with self.lock:
            self.capacities.append([tuple(m) for m in modules])  # type: ignore[misc]

    def wait_for_keys(
        self, event_type: EventType, tier: Tier, count: int, timeout: float = 10.0
    ) -> bool:
        """Wait until at least ``count`` keys were recorded for that event type and tier."""
        with self.lock:
            return self.lock.wait_for(
                lambda: len(self._keys_locked(event_type, tier)) >= count, timeout
            )

    def keys_of(self, event_type: EventType, tier: Tier) -> list[ObjectKey]:
        """Keys of every entry recorded for that event type and tier, in order."""
        with self.lock:
            return self._keys_locked(event_type, tier)

    def _keys_locked(self, event_type: EventType, tier: Tier) -> list[ObjectKey]:
        return [
            k
            for et, t, _, _, entries in self.events
            if et is event_type and t is tier
            for k, _ in entries
        ]


class FakeL2:
    """A tiny in-test L2 adapter with switches for failures and blocking."""

    def __init__(
        self, *, backend: str = "fake", shared: bool = False, capacity_bytes: int = 0
    ) -> None:
        self.backend = backend
        self.shared = shared
        self.capacity_bytes = capacity_bytes
        self.objects: dict[ObjectKey, bytes] = {}
        self.lock = threading.Lock()
        self.down = False
        self.fail_get: set[ObjectKey] = set()
        self.contains_raises = False
        self.get_log: list[ObjectKey] = []
        self.put_log: list[ObjectKey] = []
        self.deleted: list[ObjectKey] = []
        # Blocking hooks: when set, the call signals *_entered then waits on *_release.
        self.block_get: threading.Event | None = None
        self.get_entered = threading.Event()
        self.block_put: threading.Event | None = None
        self.put_entered = threading.Event()
        self.closed = False

    def _check(self) -> None:
        if self.down:
            raise L2Unavailable(f"{self.backend} is down (test)")

    def put_many(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> list[bool]:
        self._check()
        if self.block_put is not None:
            self.put_entered.set()
            assert self.block_put.wait(10), "test never released put_many"
        with self.lock:
            for key, view in items:
                self.objects[key] = bytes(view)
                self.put_log.append(key)
        return [True] * len(items)

    def get_into(self, keys: Sequence[ObjectKey], outs: Sequence[memoryview]) -> list[bool]:
        self._check()
        if self.block_get is not None:
            self.get_entered.set()
            assert self.block_get.wait(10), "test never released get_into"
        out: list[bool] = []
        with self.lock:
            for key, buf in zip(keys, outs, strict=True):
                self.get_log.append(key)
                data = self.objects.get(key)
                if data is None or key in self.fail_get or len(data) != buf.nbytes:
                    out.append(False)
                    continue
                buf[:] = data
                out.append(True)
        return out

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._check()
        if self.contains_raises:
            raise RuntimeError("contains exploded (test)")
        with self.lock:
            return [k in self.objects for k in keys]

    def delete_many(self, keys: Sequence[ObjectKey]) -> int:
        self._check()
        with self.lock:
            n = 0
            for key in keys:
                if self.objects.pop(key, None) is not None:
                    n += 1
                    self.deleted.append(key)
            return n

    def iter_entries(self) -> Iterator[L2Entry]:
        self._check()
        with self.lock:
            return iter([L2Entry(k, len(v)) for k, v in self.objects.items()])

    def usage(self) -> L2Usage:
        self._check()
        with self.lock:
            used = sum(len(v) for v in self.objects.values())
            return L2Usage(used, self.capacity_bytes, len(self.objects))

    def close(self) -> None:
        self.closed = True

    def put_bytes(self, key: ObjectKey, data: bytes) -> None:
        """Seed an object directly."""
        with self.lock:
            self.objects[key] = data


class Recorder:
    """L1Listener that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[ObjectKey], object]] = []

    def on_admitted(self, keys: Sequence[ObjectKey], sizes: Sequence[int], from_l2: bool) -> None:
        self.calls.append(("admitted", list(keys), from_l2))

    def on_removed(self, keys: Sequence[ObjectKey], sizes: Sequence[int], reason: object) -> None:
        self.calls.append(("removed", list(keys), reason))

    def on_touched(self, keys: Sequence[ObjectKey]) -> None:
        self.calls.append(("touched", list(keys), None))
