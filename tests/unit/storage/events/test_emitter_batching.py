"""Batching, numbering and capacity declarations of the emitter.

See docs/events.md, "Emitter: batching and numbering".

These run without the emitter's threads: ``flush()`` numbers the pending
events and ``unacked_batches()`` shows what would be sent.

LMCache's token events do not apply: a storage node publishes no
tokens event and stamps no token ids on its entries (chunk hashing lives in
the gateway, tested in tests/unit/common/test_hashing.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.events.config import EmitterConfig
from kvmesh.storage.events.emitter import CacheEventEmitter
from tests.unit.storage.events.fakes import FakeGate, LoopbackTransport, entry, key, key_id

GIB = 1 << 30
TS = 1_700_000_123.5


def make_emitter(**overrides: Any) -> CacheEventEmitter:
    settings: dict[str, Any] = {"instance_id": "node-a", "incarnation": 7}
    settings.update(overrides)
    return CacheEventEmitter(
        EmitterConfig(**settings), LoopbackTransport(FakeGate()), wall_clock=lambda: TS
    )


def shape(batches: list[CacheEventBatch]) -> list[tuple[int, EventType, Tier, str, bool, int]]:
    return [(b.seq, b.event_type, b.tier, b.backend, b.shared, len(b.entries)) for b in batches]


def flushed(emitter: CacheEventEmitter) -> list[CacheEventBatch]:
    emitter.flush()
    return emitter.unacked_batches()


def test_l1_store_access_evict_become_three_stamped_batches() -> None:
    em = make_emitter()
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(1, 100), entry(2, 200)])
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(3, 300)])  # store + reserve
    em.record(EventType.ACCESS, Tier.L1, "", False, [entry(1)])
    em.record(EventType.ACCESS, Tier.L1, "", False, [entry(2)])
    em.record(EventType.DELETE, Tier.L1, "dram", False, [entry(1)])

    batches = flushed(em)

    assert shape(batches) == [
        (1, EventType.STORE, Tier.L1, "dram", False, 3),
        (2, EventType.ACCESS, Tier.L1, "", False, 2),
        (3, EventType.DELETE, Tier.L1, "dram", False, 1),
    ]
    assert [e.size_bytes for e in batches[0].entries] == [100, 200, 300]
    assert all(b.instance_id == "node-a" and b.incarnation == 7 for b in batches)
    assert all(b.ts == TS for b in batches)


def test_hybrid_l1_media_become_one_run_per_backend() -> None:
    em = make_emitter()
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(1, 10)])
    em.record(EventType.STORE, Tier.L1, "devdax", False, [entry(2, 20)])
    em.record(EventType.DELETE, Tier.L1, "devdax", False, [entry(2)])

    assert [(b.event_type, b.backend) for b in flushed(em)] == [
        (EventType.STORE, "dram"),
        (EventType.STORE, "devdax"),
        (EventType.DELETE, "devdax"),
    ]


def test_l2_events_carry_backend_sizes_and_shared_runs_stay_separate() -> None:
    em = make_emitter()
    em.record(EventType.STORE, Tier.L2, "fs", False, [entry(1, 4096), entry(2, 8192)])
    em.record(EventType.STORE, Tier.L2, "fs", True, [entry(3, 1024)])
    em.record(EventType.ACCESS, Tier.L2, "fs", False, [entry(1)])
    em.record(EventType.DELETE, Tier.L2, "fs", False, [entry(2)])

    batches = flushed(em)

    assert shape(batches) == [
        (1, EventType.STORE, Tier.L2, "fs", False, 2),
        (2, EventType.STORE, Tier.L2, "fs", True, 1),
        (3, EventType.ACCESS, Tier.L2, "fs", False, 1),
        (4, EventType.DELETE, Tier.L2, "fs", False, 1),
    ]
    assert [e.size_bytes for e in batches[0].entries] == [4096, 8192]


def test_store_delete_store_of_one_key_stays_three_batches() -> None:
    em = make_emitter()
    for event_type in (EventType.STORE, EventType.DELETE, EventType.STORE):
        em.record(event_type, Tier.L2, "fs", False, [entry(1, 64)])

    batches = flushed(em)

    assert [(b.seq, b.event_type) for b in batches] == [
        (1, EventType.STORE),
        (2, EventType.DELETE),
        (3, EventType.STORE),
    ]


def test_records_merge_only_into_the_last_pending_batch() -> None:
    em = make_emitter()
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(1)])
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(2)])
    em.record(EventType.DELETE, Tier.L1, "dram", False, [entry(1)])
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(3)])

    batches = flushed(em)

    assert [[key_id(e) for e in b.entries] for b in batches] == [[1, 2], [1], [3]]


def test_empty_flush_publishes_nothing_and_consumes_no_seq() -> None:
    """An empty flush publishes nothing."""
    em = make_emitter()

    assert em.flush() == 0
    assert em.last_seq == 0
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(1)])
    assert em.flush() == 1
    assert [b.seq for b in em.unacked_batches()] == [1]
    assert em.flush() == 0
    assert em.last_seq == 1


def test_empty_record_is_ignored() -> None:
    em = make_emitter()
    em.record(EventType.STORE, Tier.L1, "dram", False, [])

    assert em.flush() == 0
    assert em.stats().records_ignored_empty == 1


def test_seqs_are_consecutive_across_flushes() -> None:
    em = make_emitter()
    for i in range(5):
        em.record(EventType.STORE, Tier.L1, "dram", False, [entry(i)])
        em.record(EventType.DELETE, Tier.L1, "dram", False, [entry(i)])
        em.flush()

    assert [b.seq for b in em.unacked_batches()] == list(range(1, 11))


def test_a_batch_holds_at_most_max_entries_and_splits_in_order() -> None:
    em = make_emitter(max_entries_per_batch=4)
    em.record(EventType.STORE, Tier.L2, "fs", False, [entry(i) for i in range(10)])
    em.record(EventType.STORE, Tier.L2, "fs", False, [entry(10)])  # fills the tail batch

    batches = flushed(em)

    assert [[key_id(e) for e in b.entries] for b in batches] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10],
    ]
    assert [b.seq for b in batches] == [1, 2, 3]


def test_a_record_tops_up_the_last_batch_before_starting_a_new_one() -> None:
    em = make_emitter(max_entries_per_batch=3)
    em.record(EventType.STORE, Tier.L2, "fs", False, [entry(0), entry(1)])
    em.record(EventType.STORE, Tier.L2, "fs", False, [entry(2), entry(3), entry(4), entry(5)])

    assert [len(b.entries) for b in flushed(em)] == [3, 3]


def test_capacity_declaration_becomes_config_batches_first_with_one_revision() -> None:
    """Config batches first, one revision, no entries, seqs [1, 2]."""
    em = make_emitter()
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(1, 10)])
    em.record_capacity([(Tier.L1, "dram", False, 16 * GIB), (Tier.L2, "fs", True, 64 * GIB)])

    batches = flushed(em)

    assert [(b.seq, b.event_type, b.tier, b.backend, b.shared) for b in batches] == [
        (1, EventType.CONFIG, Tier.L1, "dram", False),
        (2, EventType.CONFIG, Tier.L2, "fs", True),
        (3, EventType.STORE, Tier.L1, "dram", False),
    ]
    assert [(b.capacity_bytes, b.capacity_revision) for b in batches[:2]] == [
        (16 * GIB, 1),
        (64 * GIB, 1),
    ]
    assert all(not b.entries for b in batches[:2])


def test_newer_unflushed_capacity_snapshot_replaces_the_older_one() -> None:
    """The newer unflushed snapshot wins (revision 1, 16 GiB)."""
    em = make_emitter()
    em.record_capacity([(Tier.L1, "dram", False, 8 * GIB)])
    em.record_capacity([(Tier.L1, "dram", False, 16 * GIB)])

    batches = flushed(em)

    assert [(b.capacity_bytes, b.capacity_revision) for b in batches] == [(16 * GIB, 1)]


def test_each_flushed_declaration_gets_the_next_revision() -> None:
    em = make_emitter()
    em.record_capacity([(Tier.L1, "dram", False, 8 * GIB)])
    em.flush()
    em.record_capacity([(Tier.L1, "dram", False, 4 * GIB)])
    em.flush()

    assert [b.capacity_revision for b in em.unacked_batches()] == [1, 2]
    assert em.stats().capacity_revision == 2


def test_redeclare_capacity_requeues_the_last_declaration_at_a_new_revision() -> None:
    em = make_emitter()
    em.redeclare_capacity()  # nothing declared yet: nothing to do
    assert em.flush() == 0
    em.record_capacity([(Tier.L2, "fs", False, GIB)])
    em.flush()

    em.redeclare_capacity()
    em.flush()

    assert [(b.capacity_bytes, b.capacity_revision) for b in em.unacked_batches()] == [
        (GIB, 1),
        (GIB, 2),
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("flush_interval_s", -0.1),
        ("flush_interval_s", float("nan")),
        ("max_entries_per_batch", 0),
        ("max_buffered_batches", 0),
        ("max_buffered_bytes", 0),
        ("ack_timeout_s", 0.0),
        ("reconnect_base_s", 0.0),
        ("reconnect_jitter", 1.5),
        ("instance_id", ""),
        ("incarnation", -1),
    ],
)
def test_invalid_settings_are_rejected(field: str, value: object) -> None:
    """A negative flush interval (among others) is rejected."""
    with pytest.raises(InvalidArgument) as info:
        make_emitter(**{field: value})
    assert info.value.field == field


_BAD_KEY = ObjectKey(chunk_hash=b"short", model_name="m", kv_rank=0)


@pytest.mark.parametrize(
    ("event_type", "tier", "backend", "entries", "field"),
    [
        (EventType.CONFIG, Tier.L1, "dram", [entry(1)], "event_type"),
        (EventType.STORE, 0, "dram", [entry(1)], "tier"),
        (EventType.STORE, Tier.L1, "", [entry(1)], "backend"),
        (EventType.DELETE, Tier.L2, "", [entry(1)], "backend"),
        (
            EventType.STORE,
            Tier.L1,
            "dram",
            [CacheEventEntry(_BAD_KEY)],
            "entries[0].key.chunk_hash",
        ),
        (
            EventType.STORE,
            Tier.L1,
            "dram",
            [entry(1), CacheEventEntry(key(2), -1)],
            "entries[1].size_bytes",
        ),
        (
            EventType.STORE,
            Tier.L1,
            "dram",
            [CacheEventEntry(key(1), 1, (1, 2), -2)],
            "entries[0].token_offset",
        ),
    ],
)
def test_record_rejects_what_the_coordinator_would_reject(
    event_type: EventType, tier: Tier, backend: str, entries: list[CacheEventEntry], field: str
) -> None:
    em = make_emitter()

    with pytest.raises(InvalidArgument) as info:
        em.record(event_type, tier, backend, False, entries)

    assert info.value.field == field
    assert em.flush() == 0  # nothing half-recorded


def test_access_may_have_an_empty_backend() -> None:
    em = make_emitter()
    em.record(EventType.ACCESS, Tier.L2, "", False, [entry(1)])

    assert flushed(em)[0].backend == ""


def test_capacity_modules_need_a_backend_and_non_negative_bytes() -> None:
    em = make_emitter()
    with pytest.raises(InvalidArgument):
        em.record_capacity([(Tier.L1, "", False, GIB)])
    with pytest.raises(InvalidArgument):
        em.record_capacity([(Tier.L1, "dram", False, -1)])


def test_window_overflow_drops_the_oldest_batches_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    em = make_emitter(max_buffered_batches=3)
    caplog.set_level(logging.WARNING, logger="kvmesh.storage.events.emitter")
    for i in range(6):
        em.record(
            EventType.STORE if i % 2 == 0 else EventType.DELETE, Tier.L1, "dram", False, [entry(i)]
        )
        em.flush()

    assert [b.seq for b in em.unacked_batches()] == [4, 5, 6]
    stats = em.stats()
    assert (stats.batches_dropped, stats.window_depth, stats.last_seq) == (3, 3, 6)
    warnings = [r for r in caplog.records if "window full" in r.getMessage()]
    assert len(warnings) == 1


def test_window_byte_bound_drops_the_oldest_but_keeps_the_newest() -> None:
    em = make_emitter(max_buffered_bytes=2000)
    for i in range(4):
        em.record(
            EventType.STORE, Tier.L2, "fs", False, [entry(j) for j in range(10 * i, 10 * i + 10)]
        )
        em.flush()

    seqs = [b.seq for b in em.unacked_batches()]
    stats = em.stats()
    assert seqs[-1] == 4
    assert stats.batches_dropped == 4 - len(seqs) > 0
    assert stats.window_bytes <= 2000 or len(seqs) == 1


def test_overflow_that_drops_a_declaration_queues_it_again() -> None:
    """A declaration that was not delivered is re-sent at revision 2."""
    em = make_emitter(max_buffered_batches=2)
    em.record_capacity([(Tier.L1, "dram", False, GIB)])
    em.flush()
    for i in range(2):
        em.record(
            EventType.STORE if i == 0 else EventType.DELETE, Tier.L1, "dram", False, [entry(i)]
        )
        em.flush()  # the config batch (seq 1) falls out of the window

    batches = flushed(em)

    assert batches[-1].event_type is EventType.CONFIG
    assert (batches[-1].capacity_bytes, batches[-1].capacity_revision) == (GIB, 2)


def test_records_after_close_are_discarded_and_counted() -> None:
    em = make_emitter()
    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(1)])
    em.close(timeout=0.0)

    em.record(EventType.STORE, Tier.L1, "dram", False, [entry(2)])

    assert [b.seq for b in em.unacked_batches()] == [1]  # close() flushed the first
    assert em.stats().records_after_close == 1
    assert em.flush() == 0


def test_a_batch_holds_the_changes_of_one_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvmesh.storage.events.emitter as emitter_module

    em = make_emitter()
    current = {"traceparent": ""}
    monkeypatch.setattr(emitter_module, "current_traceparent", lambda: current["traceparent"])
    lookup = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    retrieve = "00-" + "ef" * 16 + "-" + "12" * 8 + "-01"
    em.record(EventType.ACCESS, Tier.L1, "", False, [entry(1)])  # untraced
    current["traceparent"] = lookup  # a lookup's LRU touch, in the lookup's own trace
    em.record(EventType.ACCESS, Tier.L1, "", False, [entry(2)])
    em.record(EventType.ACCESS, Tier.L1, "", False, [entry(3)])
    current["traceparent"] = retrieve  # the retrieve right after it
    em.record(EventType.ACCESS, Tier.L1, "", False, [entry(4)])
    current["traceparent"] = ""
    em.record(EventType.ACCESS, Tier.L1, "", False, [entry(5)])

    batches = flushed(em)

    assert [(b.traceparent, [key_id(e) for e in b.entries]) for b in batches] == [
        ("", [1]),
        (lookup, [2, 3]),
        (retrieve, [4]),
        ("", [5]),
    ]
