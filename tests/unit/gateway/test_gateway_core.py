"""The gateway core's request semantics, against an in-memory NodeStorage.

The fake keeps per-key read-lock counts, and holds a lookup's locks in the
real lease table (``kvmesh.storage.core.lookup_leases``), so every test can
check that a lock taken by a lookup is released exactly once, whichever path
releases it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from kvmesh.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.common.node_types import PrefetchState, Slot, StoreOutcome
from kvmesh.gateway.core import EngineSpec, Gateway, PromptRangeSpec
from kvmesh.gateway.core.node_storage import KeyGridSpec, KeyRow, PreparedSlots
from kvmesh.storage.core.controllers.prefetch_types import PrefetchResult
from kvmesh.storage.core.lookup_leases import LookupLeases

CHUNK = 16
BLOCK = 4
MODEL = "m"


class FakeStorage:
    """NodeStorage with L1 residency, read-lock counts and an optional slow 'L2'."""

    # Like a remote node: the gateway must shield its calls.
    cancel_safe = False

    def __init__(self) -> None:
        self.resident: set[ObjectKey] = set()
        self.l2: set[ObjectKey] = set()
        self.locks: Counter[ObjectKey] = Counter()
        self.engines: dict[str, object] = {}
        self.pending: dict[str, tuple[KeyGridSpec, int]] = {}
        self.l2_release = asyncio.Event()
        self.l2_release.set()
        self.abandoned: set[str] = set()
        self.touched: list[ObjectKey] = []
        self.next_id = 0
        self.retrieve_masks: list[list[bool]] = []
        self.producer_events: list[bytes] = []
        self.prepared: dict[str, list[ObjectKey]] = {}
        self.leases = LookupLeases(self, ttl_s=1e9, read_ttl_s=2e9)  # type: ignore[arg-type]

    def finish_read(self, keys: Sequence[ObjectKey], count: int) -> None:
        """What the lease table calls (StorageManager.finish_read)."""
        for k in keys:
            assert self.locks[k] >= count, f"over-release on {k}"
            self.locks[k] -= count

    @staticmethod
    def keys(grid: KeyGridSpec) -> list[list[ObjectKey]]:
        return [
            [ObjectKey(h, grid.model_name, r, 0, grid.cache_salt) for h in grid.chunk_hashes]
            for r in grid.kv_ranks
        ]

    async def register_engine(self, engine_id: str, registration: object) -> tuple[bool, str]:
        already = engine_id in self.engines
        self.engines[engine_id] = registration
        return already, "node-test"

    async def unregister_engine(self, engine_id: str) -> bool:
        return self.engines.pop(engine_id, None) is not None

    def _finish(self, grid: KeyGridSpec, readers: int, pid: str = "") -> PrefetchState:
        rows = self.keys(grid)
        hit = 0
        l2_hits = 0
        for c in range(len(grid.chunk_hashes)):
            col = [row[c] for row in rows]
            if all(k in self.resident for k in col):
                hit += 1
            elif all(k in self.resident or k in self.l2 for k in col):
                hit += 1
                l2_hits += 1
                self.resident.update(col)
            else:
                break
        for row in rows:
            for k in row[:hit]:
                self.locks[k] += readers
        locked = tuple(k for row in rows for k in row[:hit])
        result = PrefetchResult(pid, hit, len(rows), len(grid.chunk_hashes), readers, 0, 0, locked)
        self.leases.grant(pid, result)
        return PrefetchState("", True, hit, hit - l2_hits, l2_hits)

    async def lookup_and_lock(
        self, request_id: str, grid: KeyGridSpec, readers: int, wait_ms: int, owner: str = ""
    ) -> PrefetchState:
        self.next_id += 1
        pid = f"p{self.next_id}"
        self.leases.expect(pid, owner)
        needs_l2 = any(
            k in self.l2 and k not in self.resident for row in self.keys(grid) for k in row
        )
        if needs_l2 and not self.l2_release.is_set():
            self.pending[pid] = (grid, readers)
            return PrefetchState(pid, False)
        state = self._finish(grid, readers, pid)
        return PrefetchState(pid, True, state.hit_chunks, state.l1_hit_chunks, state.l2_hit_chunks)

    async def prefetch_status(self, prefetch_id: str, wait_ms: int) -> PrefetchState:
        if prefetch_id not in self.pending:
            raise AssertionError(f"status of unknown prefetch {prefetch_id}")
        if not self.l2_release.is_set():
            return PrefetchState(prefetch_id, False)
        grid, readers = self.pending.pop(prefetch_id)
        state = self._finish(grid, readers, prefetch_id)
        return PrefetchState(
            prefetch_id, True, state.hit_chunks, state.l1_hit_chunks, state.l2_hit_chunks
        )

    async def end_lease(self, lease_id: str) -> int:
        existed, released = self.leases.end(lease_id)
        if not existed and self.pending.pop(lease_id, None) is not None:
            self.leases.forget_pending(lease_id)
            self.abandoned.add(lease_id)
        return released

    async def release_lease(self, lease_id: str, first_chunk: int, last_chunk: int) -> int:
        return self.leases.release(lease_id, first_chunk, last_chunk)

    async def end_owner_leases(self, owner: str) -> int:
        ended, running = self.leases.end_owner(owner)
        for lease_id in running:
            await self.end_lease(lease_id)
        return ended + len(running)

    async def store_chunks(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        chunk_tokens: int,
        producer_event: bytes = b"",
    ) -> list[StoreOutcome]:
        self.producer_events.append(producer_event)
        out = []
        for h in row.chunk_hashes:
            key = ObjectKey(h, row.model_name, row.kv_rank, 0, row.cache_salt)
            if key in self.resident:
                out.append(StoreOutcome.ALREADY_CACHED)
            else:
                self.resident.add(key)
                out.append(StoreOutcome.STORED)
        return out

    async def retrieve_chunks(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        chunk_tokens: int,
        skip_first_n_tokens: int,
        lease_id: str,
        producer_event: bytes = b"",
        layers: tuple[int, int] | None = None,
    ) -> int:
        self.producer_events.append(producer_event)
        keys = [
            ObjectKey(h, row.model_name, row.kv_rank, 0, row.cache_salt) for h in row.chunk_hashes
        ]
        release_mask = self.leases.consume(lease_id, keys)
        self.retrieve_masks.append(list(release_mask))
        got = 0
        for k in keys:
            if k not in self.resident:
                break
            got += 1
        for k, release in zip(keys, release_mask, strict=False):
            if release:
                assert self.locks[k] > 0, f"released a lock that was not held on {k}"
                self.locks[k] -= 1
        return got

    async def touch(self, grid: KeyGridSpec) -> None:
        for row in self.keys(grid):
            self.touched.extend(row)

    async def clear(self, force: bool) -> int:
        n = len(self.resident)
        self.resident.clear()
        return n

    async def prepare_store(self, row: KeyRow, chunk_bytes: int) -> PreparedSlots:
        return PreparedSlots("t1", [Slot(0, "/dev/shm/x", 0, chunk_bytes)])

    async def commit_store(self, transaction_id: str) -> int:
        return 1

    async def prepare_retrieve(self, row: KeyRow, chunk_bytes: int) -> PreparedSlots:
        self.prepared["r1"] = [
            ObjectKey(h, row.model_name, row.kv_rank, 0, row.cache_salt) for h in row.chunk_hashes
        ]
        return PreparedSlots("r1", [Slot(0, "/dev/shm/x", 0, chunk_bytes)])

    async def commit_retrieve(self, transaction_id: str, lease_id: str) -> int:
        keys = self.prepared.pop(transaction_id, [])
        mask = self.leases.consume(lease_id, keys)
        self.finish_read([k for k, flag in zip(keys, mask, strict=True) if flag], 1)
        return len(keys)

    def held(self) -> int:
        return sum(self.locks.values())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.uint32)


def make(storage: FakeStorage | None = None, **kw: object) -> tuple[Gateway, FakeStorage, Clock]:
    storage = storage or FakeStorage()
    clock = Clock()
    gw = Gateway(storage, chunk_size=CHUNK, clock=clock, **kw)  # type: ignore[arg-type]
    return gw, storage, clock


def register(gw: Gateway, engine_id: str = "e0", world: int = 1, worker: int = 0) -> None:
    asyncio.run(
        gw.register_kv_cache(EngineSpec(engine_id, MODEL, world, worker, BLOCK), object(), "fp")
    )


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def store_all(gw: Gateway, toks: np.ndarray, request_id: str = "s", engine_id: str = "e0") -> None:
    end = (toks.size // CHUNK) * CHUNK
    rng = PromptRangeSpec(request_id, MODEL, 1, "", toks, 0, end)
    run(gw.store(engine_id, rng, list(range(end // BLOCK))))


def test_hashes_match_the_shared_token_hasher() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(3 * CHUNK)
    store_all(gw, toks)
    expected = TokenHasher(CHUNK).hash_chunks(toks)
    rank = worker_kv_rank(1, 0)
    assert storage.resident == {ObjectKey(h, MODEL, rank, 0, "") for h in expected}


def test_lookup_without_registered_engine_is_an_immediate_miss() -> None:
    gw, storage, _ = make()
    status, requested = run(gw.lookup("r", MODEL, 1, "", tokens(64), 0, 1, 0))
    assert status.completed
    assert status.hit_chunks == 0
    assert requested == 4
    assert storage.held() == 0


def test_lookup_locks_prefix_and_end_session_releases_every_lock() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(4 * CHUNK)
    store_all(gw, toks[: 2 * CHUNK])
    status, requested = run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    assert (status.completed, status.hit_chunks, status.hit_tokens, requested) == (True, 2, 32, 4)
    assert storage.held() == 2
    existed, released = run(gw.end_session("r"))
    assert existed
    assert released == 2
    assert storage.held() == 0
    assert len(storage.touched) == 4  # every complete chunk of the lookup, for LRU recency


def test_end_session_of_unknown_request_is_harmless() -> None:
    gw, _, _ = make()
    assert run(gw.end_session("nope")) == (False, 0)


def test_query_of_unknown_request_is_not_found() -> None:
    gw, _, _ = make()
    with pytest.raises(NotFound):
        run(gw.query_prefetch_status("nope"))
    with pytest.raises(NotFound):
        run(gw.free_lookup_locks("nope", 0, CHUNK))


def test_finished_result_can_be_queried_repeatedly() -> None:
    gw, _storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    store_all(gw, toks)
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    first = run(gw.query_prefetch_status("r"))
    second = run(gw.query_prefetch_status("r"))
    assert first == second
    assert first.hit_chunks == 2


def test_l2_prefetch_completes_later_and_query_reports_it() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(3 * CHUNK)
    hashes = TokenHasher(CHUNK).hash_chunks(toks)
    rank = worker_kv_rank(1, 0)
    storage.resident.add(ObjectKey(hashes[0], MODEL, rank))
    storage.l2.update(ObjectKey(h, MODEL, rank) for h in hashes[1:])
    storage.l2_release.clear()
    status, _ = run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    assert not status.completed
    assert not run(gw.query_prefetch_status("r")).completed
    storage.l2_release.set()
    done = run(gw.query_prefetch_status("r"))
    assert (done.completed, done.hit_chunks, done.l1_hit_chunks, done.l2_hit_chunks) == (
        True,
        3,
        1,
        2,
    )


def test_free_lookup_locks_while_prefetch_runs_releases_nothing() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    hashes = TokenHasher(CHUNK).hash_chunks(toks)
    storage.l2.update(ObjectKey(h, MODEL, worker_kv_rank(1, 0)) for h in hashes)
    storage.l2_release.clear()
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    assert run(gw.free_lookup_locks("r", 0, 2 * CHUNK)) == 0


def test_end_session_abandons_a_running_prefetch() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    hashes = TokenHasher(CHUNK).hash_chunks(toks)
    storage.l2.update(ObjectKey(h, MODEL, worker_kv_rank(1, 0)) for h in hashes)
    storage.l2_release.clear()
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    run(gw.end_session("r"))
    assert storage.abandoned == {"p1"}


def test_free_then_retrieve_then_end_release_each_lock_exactly_once() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(4 * CHUNK)
    store_all(gw, toks)
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    assert storage.held() == 4
    # The scheduler frees the APC-covered first chunk, the worker retrieves 1..3.
    assert run(gw.free_lookup_locks("r", 0, CHUNK)) == 1
    assert run(gw.free_lookup_locks("r", 0, CHUNK)) == 0  # twice is harmless
    rng = PromptRangeSpec("r", MODEL, 1, "", np.zeros(0, np.uint32), CHUNK, 4 * CHUNK)
    got = run(gw.retrieve("e0", rng, list(range(3 * CHUNK // BLOCK)), 0))
    assert got == 3
    assert storage.retrieve_masks == [[True, True, True]]
    assert storage.held() == 0
    assert run(gw.end_session("r")) == (True, 0)


def test_retrieve_without_lookup_releases_nothing() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    store_all(gw, toks)
    rng = PromptRangeSpec("r2", MODEL, 1, "", toks, 0, 2 * CHUNK)
    assert run(gw.retrieve("e0", rng, list(range(8)), 0)) == 2
    assert storage.retrieve_masks == [[False, False]]


def test_the_engines_cuda_event_reaches_storage_with_its_copy() -> None:
    """GPU engines order storage's copies after their stream through an IPC event."""
    gw, storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    event = bytes(range(64))
    rng = PromptRangeSpec("r1", MODEL, 1, "", toks, 0, 2 * CHUNK)
    run(gw.store("e0", rng, list(range(8)), event))
    rng = PromptRangeSpec("r2", MODEL, 1, "", toks, 0, 2 * CHUNK)
    assert run(gw.retrieve("e0", rng, list(range(8)), 0, event)) == 2
    assert storage.producer_events == [event, event]


def test_new_lookup_for_same_request_releases_the_previous_locks() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    store_all(gw, toks)
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    assert storage.held() == 2  # not 4


def test_num_kv_readers_multiplies_locks_and_all_are_released() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    store_all(gw, toks)
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 3, 0))
    assert storage.held() == 6
    assert run(gw.end_session("r"))[1] == 6
    assert storage.held() == 0


def test_lookup_spans_every_kv_rank_of_the_world() -> None:
    gw, storage, _ = make()
    for worker in range(2):
        register(gw, f"e{worker}", world=2, worker=worker)
    toks = tokens(2 * CHUNK)
    hashes = TokenHasher(CHUNK).hash_chunks(toks)
    # Rank 0 has both chunks, rank 1 only the first: the servable prefix is 1.
    storage.resident.update(ObjectKey(h, MODEL, worker_kv_rank(2, 0)) for h in hashes)
    storage.resident.add(ObjectKey(hashes[0], MODEL, worker_kv_rank(2, 1)))
    status, _ = run(gw.lookup("r", MODEL, 2, "", toks, 0, 1, 0))
    assert status.hit_chunks == 1
    assert storage.held() == 2


def test_session_expires_after_idleness_not_age_and_releases_locks() -> None:
    gw, storage, clock = make(session_ttl_s=100.0)
    register(gw)
    toks = tokens(2 * CHUNK)
    store_all(gw, toks)
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    clock.now += 90
    run(gw.query_prefetch_status("r"))  # use refreshes the session
    clock.now += 90
    run(gw.sweep())
    assert run(gw.query_prefetch_status("r")).hit_chunks == 2  # 180 s old, 90 s idle: alive
    clock.now += 101
    run(gw.sweep())
    with pytest.raises(NotFound):
        run(gw.query_prefetch_status("r"))
    assert storage.held() == 0
    assert gw.stats()["sessions_expired"] >= 1


def test_chunk_size_not_multiple_of_block_size_is_rejected_at_registration() -> None:
    gw, _, _ = make()
    with pytest.raises(InvalidArgument) as err:
        run(gw.register_kv_cache(EngineSpec("e", MODEL, 1, 0, 5), object(), "fp"))
    assert err.value.reason == "CHUNK_SIZE_MISMATCH"


def test_reregister_with_same_layout_is_idempotent_and_other_layout_refused() -> None:
    gw, _, _ = make()
    spec = EngineSpec("e", MODEL, 1, 0, BLOCK)
    assert run(gw.register_kv_cache(spec, object(), "fp")) is False
    assert run(gw.register_kv_cache(spec, object(), "fp")) is True
    with pytest.raises(AlreadyExists) as err:
        run(gw.register_kv_cache(spec, object(), "other"))
    assert err.value.reason == "ENGINE_LAYOUT_MISMATCH"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (EngineSpec("", MODEL, 1, 0, BLOCK), "engine_id"),
        (EngineSpec("e", "a@b", 1, 0, BLOCK), "model_name"),
        (EngineSpec("e", MODEL, 0, 0, BLOCK), "world_size"),
        (EngineSpec("e", MODEL, 2, 2, BLOCK), "worker_id"),
    ],
)
def test_bad_engine_registration_names_the_field(spec: EngineSpec, field: str) -> None:
    gw, _, _ = make()
    with pytest.raises(InvalidArgument) as err:
        run(gw.register_kv_cache(spec, object(), "fp"))
    assert err.value.field == field


def test_store_before_register_is_failed_precondition() -> None:
    gw, _, _ = make()
    rng = PromptRangeSpec("r", MODEL, 1, "", tokens(CHUNK), 0, CHUNK)
    with pytest.raises(FailedPrecondition):
        run(gw.store("e0", rng, list(range(4))))


@pytest.mark.parametrize(
    ("start", "end", "n_blocks", "field"),
    [
        (0, 3 * CHUNK, 12, "end_token"),  # beyond the prompt's 2 chunks
        (1, CHUNK, 4, "start_token"),  # not aligned
        (0, CHUNK + 1, 8, "end_token"),  # not aligned
        (0, 2 * CHUNK, 7, "block_ids"),  # too few block ids
    ],
)
def test_bad_store_ranges_are_invalid_argument(
    start: int, end: int, n_blocks: int, field: str
) -> None:
    gw, storage, _ = make()
    register(gw)
    rng = PromptRangeSpec("r", MODEL, 1, "", tokens(2 * CHUNK), start, end)
    with pytest.raises(InvalidArgument) as err:
        run(gw.store("e0", rng, list(range(n_blocks))))
    assert err.value.field == field
    assert storage.resident == set()


def test_lookup_rejects_end_beyond_prompt_and_bad_salt() -> None:
    gw, _, _ = make()
    with pytest.raises(InvalidArgument):
        run(gw.lookup("r", MODEL, 1, "", tokens(CHUNK), CHUNK + 1, 1, 0))
    with pytest.raises(InvalidArgument):
        run(gw.lookup("r", MODEL, 1, "a/b", tokens(CHUNK), 0, 1, 0))
    with pytest.raises(InvalidArgument):
        run(gw.lookup("", MODEL, 1, "", tokens(CHUNK), 0, 1, 0))


def test_cache_salt_separates_tenants() -> None:
    gw, _storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    store_all(gw, toks)
    status, _ = run(gw.lookup("r", MODEL, 1, "tenant-b", toks, 0, 1, 0))
    assert status.hit_chunks == 0


def test_tokens_can_be_omitted_once_the_session_has_them() -> None:
    gw, storage, _ = make()
    register(gw)
    toks = tokens(2 * CHUNK)
    run(gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0))
    rng = PromptRangeSpec("r", MODEL, 1, "", np.zeros(0, np.uint32), 0, 2 * CHUNK)
    run(gw.store("e0", rng, list(range(8))))
    assert len(storage.resident) == 2
