"""Delivery of cache events: timer flushing, acks, reconnects, resends and the bounded window.

The emitter's real threads run against a LoopbackTransport feeding a fake
gate with the coordinator's admission rules. Nothing sleeps for a fixed time:
each test waits on a condition with a deadline.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvmesh.common.events import EventType, IngestResult, Tier
from kvmesh.storage.events.config import (
    DEFAULT_MAX_IN_FLIGHT_BATCHES,
    EmitterConfig,
    ReconnectBackoff,
)
from kvmesh.storage.events.emitter import CacheEventEmitter
from tests.support.waiting import wait_until
from tests.unit.storage.events.fakes import DEADLINE_S, FakeGate, LoopbackTransport, entry, key_id

INSTANCE = "node-a"


class Rig:
    """A started emitter wired through a LoopbackTransport to a FakeGate."""

    def __init__(self, **overrides: Any) -> None:
        settings: dict[str, Any] = {
            "instance_id": INSTANCE,
            "incarnation": 3,
            "flush_interval_s": 3600.0,  # tests flush explicitly unless they test the timer
            "ack_timeout_s": 30.0,
            "reconnect_base_s": 0.001,
            "reconnect_max_s": 0.01,
        }
        settings.update(overrides)
        self.gate = FakeGate()
        self.transport = LoopbackTransport(self.gate)
        self.emitter = CacheEventEmitter(
            EmitterConfig(**settings), self.transport, rng=random.Random(1)
        )

    def start(self) -> Rig:
        self.emitter.start()
        return self

    def store(self, *ids: int, event_type: EventType = EventType.STORE) -> None:
        self.emitter.record(event_type, Tier.L2, "fs", False, [entry(i, 10) for i in ids])

    def distinct_batches(self, count: int, start: int = 0) -> None:
        """``count`` one-entry batches that cannot merge (alternating types), flushed."""
        for i in range(start, start + count):
            self.store(i, event_type=EventType.STORE if i % 2 == 0 else EventType.DELETE)
            self.emitter.flush()

    def admitted_ids(self) -> list[int]:
        return [key_id(e) for b in self.gate.admitted for e in b.entries]

    def gap(self) -> bool:
        cursor = self.gate.cursors.get(INSTANCE)
        return cursor is not None and cursor.gap_detected


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig().start()
    yield made
    made.emitter.close(timeout=1.0)


def emitter_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("event-")]


def test_timer_flush_delivers_without_an_explicit_flush() -> None:
    """A buffered tail is flushed once the interval has passed."""
    r = Rig(flush_interval_s=0.02).start()
    try:
        r.store(1)
        assert r.gate.wait_for(lambda g: len(g.admitted) == 1)
        assert r.admitted_ids() == [1]
    finally:
        r.emitter.close(timeout=1.0)


def test_full_batch_flushes_at_once_and_a_partial_tail_waits_for_the_timer() -> None:
    r = Rig(max_entries_per_batch=8).start()  # hour-long timer
    try:
        r.store(*range(8))
        assert r.gate.wait_for(lambda g: len(g.admitted) == 1)

        r.store(8)

        stats = r.emitter.stats()
        assert (stats.pending_entries, stats.last_seq) == (1, 1)
    finally:
        assert r.emitter.close(timeout=DEADLINE_S)
    assert r.gate.admitted_seqs() == [1, 2]  # close() flushed the tail
    assert r.admitted_ids() == list(range(9))


def test_interval_zero_flushes_every_record() -> None:
    """With interval 0 every record is flushed."""
    r = Rig(flush_interval_s=0.0).start()
    try:
        r.store(1)
        assert r.gate.wait_for(lambda g: len(g.admitted) == 1)
        r.store(2)
        assert r.gate.wait_for(lambda g: len(g.admitted) == 2)
    finally:
        r.emitter.close(timeout=1.0)


def test_close_flushes_waits_for_acks_and_stops_threads() -> None:
    """Shutdown flushes and closes the stream."""
    r = Rig().start()
    r.store(1, 2)
    r.emitter.record_capacity([(Tier.L2, "fs", False, 1 << 30)])

    assert r.emitter.close(timeout=DEADLINE_S) is True

    assert [b.event_type for b in r.gate.admitted] == [EventType.CONFIG, EventType.STORE]
    stats = r.emitter.stats()
    assert (stats.window_depth, stats.batches_acked, stats.acks_admitted) == (0, 2, 2)
    assert emitter_threads_alive() == []
    assert not r.transport.connected  # the stream was closed


def test_close_with_the_coordinator_down_gives_up_at_the_deadline() -> None:
    r = Rig()
    r.transport.set_down(True)
    r.start()
    r.store(1)

    assert r.emitter.close(timeout=0.2) is False

    assert r.emitter.stats().window_depth == 1
    assert emitter_threads_alive() == []


def test_a_failed_send_is_resent_so_the_gate_sees_no_gap(rig: Rig) -> None:
    """Changed from LMCache on purpose: a failed send is resent, leaving no gap."""
    # LMCache drops a batch whose publish failed (seq 2 follows a gap); kvmesh resends it.
    rig.transport.fail_next_sends(1)
    rig.store(1)
    rig.emitter.flush()
    rig.store(2, event_type=EventType.DELETE)
    rig.emitter.flush()

    assert rig.emitter.wait_until_acked(2, DEADLINE_S)

    assert rig.gate.admitted_seqs() == [1, 2]
    assert not rig.gap()
    stats = rig.emitter.stats()
    assert stats.disconnects >= 1
    assert stats.reconnects >= 1
    assert "loopback stream broke" in stats.last_error


def test_a_lost_ack_is_resent_and_the_duplicate_counts_as_delivered(rig: Rig) -> None:
    rig.transport.fail_next_sends(1, after_delivery=True)
    rig.distinct_batches(2)

    assert rig.emitter.wait_until_acked(2, DEADLINE_S)

    assert rig.gate.admitted_seqs() == [1, 2]
    assert rig.gate.duplicates() >= 1
    assert rig.emitter.stats().acks_duplicate >= 1
    assert rig.emitter.stats().batches_resent >= 1


def test_coordinator_down_at_start_then_up_delivers_everything_in_order() -> None:
    r = Rig()
    r.transport.set_down(True)
    r.start()
    try:
        r.distinct_batches(5)
        assert wait_until(lambda: r.emitter.stats().connect_failures >= 3)
        assert r.gate.admitted == []

        r.transport.set_down(False)

        assert r.emitter.wait_until_acked(5, DEADLINE_S)
        assert r.gate.admitted_seqs() == [1, 2, 3, 4, 5]
        assert not r.gap()
    finally:
        r.emitter.close(timeout=1.0)


@pytest.mark.parametrize("after_delivery", [False, True], ids=["lost-in-transit", "ack-lost"])
def test_exactly_once_in_order_through_repeated_disconnects(after_delivery: bool) -> None:
    r = Rig(max_entries_per_batch=3, max_in_flight_batches=4).start()
    r.transport.disconnect_every(5, after_delivery=after_delivery)
    recorded: list[int] = []
    try:
        for i in range(200):
            ids = [3 * i, 3 * i + 1] if i % 3 else [3 * i]
            r.store(*ids, event_type=EventType.STORE if i % 4 else EventType.DELETE)
            recorded.extend(ids)
            if i % 7 == 0:
                r.emitter.flush()
        r.emitter.flush()
        last = r.emitter.last_seq
        assert r.emitter.wait_until_acked(last, DEADLINE_S)
    finally:
        r.transport.disconnect_every(None)
        assert r.emitter.close(timeout=DEADLINE_S)

    assert r.gate.admitted_seqs() == list(range(1, last + 1))
    assert r.admitted_ids() == recorded
    assert not r.gap()
    assert r.transport.sessions_opened > 10
    stats = r.emitter.stats()
    assert stats.batches_resent > 0
    assert stats.batches_acked == last
    if after_delivery:
        assert r.gate.duplicates() > 0


def test_unanswered_stream_times_out_reconnects_and_resends() -> None:
    r = Rig(ack_timeout_s=0.05).start()
    try:
        r.transport.set_drop_acks(True)
        r.distinct_batches(2)
        assert wait_until(lambda: r.emitter.stats().disconnects >= 2)
        assert r.gate.admitted_seqs() == [1, 2]  # delivered, only the acks were lost
        assert r.emitter.stats().window_depth == 2

        r.transport.set_drop_acks(False)

        assert r.emitter.wait_until_acked(2, DEADLINE_S)
        assert r.gate.admitted_seqs() == [1, 2]
        assert r.gate.duplicates() >= 1
    finally:
        r.emitter.close(timeout=1.0)


def test_window_overflow_while_disconnected_shows_up_as_a_gap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmesh.storage.events.emitter")
    r = Rig(max_buffered_batches=3)
    r.transport.set_down(True)
    r.start()
    try:
        r.distinct_batches(6)
        assert r.emitter.stats().batches_dropped == 3

        r.transport.set_down(False)

        assert r.emitter.wait_until_acked(6, DEADLINE_S)
        assert r.gate.admitted_seqs() == [4, 5, 6]
        assert r.gap()
        assert len([m for m in caplog.messages if "window full" in m]) == 1
    finally:
        r.emitter.close(timeout=1.0)


def test_stale_incarnation_acks_count_as_delivered_and_log_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="kvmesh.storage.events.emitter")
    r = Rig(incarnation=3)
    newer = Rig(incarnation=4)
    newer.gate = r.gate
    newer.transport = LoopbackTransport(r.gate)
    newer.emitter = CacheEventEmitter(EmitterConfig(INSTANCE, 4), newer.transport)
    newer.store(100)
    newer.emitter.flush()
    newer.emitter.start()
    assert newer.emitter.close(timeout=DEADLINE_S)
    r.start()
    try:
        r.distinct_batches(3)

        assert r.emitter.wait_until_acked(3, DEADLINE_S)

        assert r.emitter.stats().acks_stale == 3
        assert r.gate.admitted_seqs() == [1]  # only the newer incarnation's batch
        assert len([m for m in caplog.messages if "STALE_INCARNATION" in m]) == 1
    finally:
        r.emitter.close(timeout=1.0)


def test_recording_from_many_threads_concurrently_loses_nothing() -> None:
    r = Rig(flush_interval_s=0.005, max_entries_per_batch=16).start()
    r.transport.disconnect_every(11)
    threads_n, records_n = 8, 400
    start = threading.Barrier(threads_n)

    def worker(t: int) -> None:
        start.wait()
        for i in range(records_n):
            kind = EventType.STORE if i % 5 else EventType.ACCESS
            r.store(t * 1_000_000 + i, event_type=kind)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(DEADLINE_S)
    try:
        r.emitter.flush()
        assert r.emitter.wait_until_acked(r.emitter.last_seq, DEADLINE_S)
    finally:
        r.transport.disconnect_every(None)
        r.emitter.close(timeout=DEADLINE_S)

    ids = r.admitted_ids()
    assert len(ids) == threads_n * records_n
    for t in range(threads_n):
        mine = [i - t * 1_000_000 for i in ids if i // 1_000_000 == t]
        assert mine == list(range(records_n))  # each thread's order is kept
    assert r.gate.admitted_seqs() == list(range(1, r.emitter.last_seq + 1))


def test_acks_for_unknown_seqs_or_results_are_ignored(rig: Rig) -> None:
    rig.transport.set_drop_acks(True)
    rig.distinct_batches(1)
    assert rig.gate.wait_for(lambda g: len(g.admitted) == 1)
    listener = rig.transport._session.listener  # type: ignore[union-attr]

    listener.on_ack(99, IngestResult.ADMITTED)
    listener.on_ack(1, 42)  # type: ignore[arg-type]

    assert rig.emitter.stats().window_depth == 1
    listener.on_ack(1, IngestResult.ADMITTED)
    assert rig.emitter.stats().window_depth == 0


def test_stats_report_connection_and_window_state(rig: Rig) -> None:
    assert wait_until(lambda: rig.emitter.stats().connected)
    rig.transport.set_drop_acks(True)
    rig.distinct_batches(2)
    assert rig.gate.wait_for(lambda g: len(g.admitted) == 2)

    stats = rig.emitter.stats()

    assert (stats.last_seq, stats.window_depth, stats.batches_flushed) == (2, 2, 2)
    assert stats.batches_sent == 2
    assert stats.window_bytes > 0
    assert (stats.instance_id, stats.incarnation) == (INSTANCE, 3)
    rig.transport.set_drop_acks(False)
    rig.transport.disconnect()  # the resend on the new stream gets acked
    assert rig.emitter.wait_until_acked(2, DEADLINE_S)


@pytest.mark.parametrize(
    "limit",
    # The default is what ``kvmesh bench ingest`` measures (its window is this constant).
    [{"max_in_flight_batches": 2}, {}],
    ids=["explicit-2", "default"],
)
def test_in_flight_batches_are_bounded_per_stream(limit: dict[str, int]) -> None:
    assert DEFAULT_MAX_IN_FLIGHT_BATCHES == 2
    r = Rig(**limit, ack_timeout_s=0.05)
    r.transport.set_drop_acks(True)
    r.distinct_batches(5)
    r.start()
    try:
        # Each stream stalls with 2 unacked batches until the ack timeout kills it.
        assert wait_until(lambda: r.emitter.stats().disconnects >= 2)
        assert {b.seq for b in list(r.transport.delivered)} == {1, 2}

        r.transport.set_drop_acks(False)

        assert r.emitter.wait_until_acked(5, DEADLINE_S)
        assert r.gate.admitted_seqs() == [1, 2, 3, 4, 5]
    finally:
        r.emitter.close(timeout=1.0)


def test_reconnect_backoff_doubles_up_to_the_cap_with_bounded_jitter() -> None:
    plain = ReconnectBackoff(0.1, 0.8, 0.0, random.Random(0))
    assert [plain.next_delay() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 0.8, 0.8])
    plain.reset()
    assert plain.next_delay() == pytest.approx(0.1)

    jittered = ReconnectBackoff(0.1, 0.8, 0.5, random.Random(0))
    delays = [jittered.next_delay() for _ in range(200)]
    nominal = [min(0.1 * 2**i, 0.8) for i in range(200)]
    assert all(0.5 * n <= d <= n for d, n in zip(delays, nominal, strict=True))
    assert len({round(d, 9) for d in delays[5:]}) > 1  # jitter actually varies
