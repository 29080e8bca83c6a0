"""EventGate and QuiesceLock (docs/coordinator.md, "Event gate")."""

from __future__ import annotations

import threading

import pytest

from kvmesh.common.events import IngestResult, Tier
from kvmesh.coordinator.core import (
    CacheEventBroadcaster,
    EventGate,
    KeyDirectory,
    KeySpaces,
    QuiesceLock,
    QuiesceTimeout,
)
from tests.support.waiting import wait_until
from tests.unit.coordinator.coord_testkit import FakeClock, RecordingConsumer, Stream, key


def make_gate(*consumers: RecordingConsumer, wall: FakeClock | None = None) -> EventGate:
    b = CacheEventBroadcaster()
    for c in consumers:
        b.register(c, name=c.name)
    return EventGate(b, QuiesceLock(), wall_clock=wall or FakeClock())


def test_admitted_batch_reaches_every_consumer() -> None:
    """A valid batch is ADMITTED and both consumers get exactly it."""
    c1, c2 = RecordingConsumer("c1"), RecordingConsumer("c2")
    gate = make_gate(c1, c2)
    batch = Stream().store([key(1)])
    assert gate.ingest(batch) is IngestResult.ADMITTED
    assert c1.batches == [batch]
    assert c2.batches == [batch]


def test_ingest_without_consumers_is_admitted() -> None:
    assert make_gate().ingest(Stream().store([key(1)])) is IngestResult.ADMITTED


def test_ingest_batches_counts_and_keeps_list_order() -> None:
    """[seq1, seq2] → applied 2, delivered in list order."""
    c = RecordingConsumer()
    s = Stream()
    b1, b2 = s.store([key(1)]), s.store([key(2)])
    summary = make_gate(c).ingest_batches([b1, b2])
    assert (summary.applied, summary.duplicates, summary.stale) == (2, 0, 0)
    assert [b.seq for b in c.batches] == [1, 2]


def test_mixed_list_counts_applied_duplicate_and_stale() -> None:
    """[inc2 s1, inc2 s1, inc1 s9, inc2 s2] → 2/1/1, only first and last delivered."""
    c = RecordingConsumer()
    s2 = Stream(incarnation=2)
    first = s2.store([key(1)], seq=1)
    again = s2.store([key(1)], seq=1)
    old = Stream(incarnation=1).store([key(9)], seq=9)
    last = s2.store([key(2)], seq=2)
    summary = make_gate(c).ingest_batches([first, again, old, last])
    assert (summary.applied, summary.duplicates, summary.stale) == (2, 1, 1)
    assert c.batches == [first, last]


def test_new_incarnation_within_one_list_fences_once() -> None:
    """[inc1 s1, inc2 s1] → applied 2 and node-a fenced once."""
    c = RecordingConsumer()
    summary = make_gate(c).ingest_batches(
        [Stream(incarnation=1).store([key(1)]), Stream(incarnation=2).store([key(2)])]
    )
    assert summary.applied == 2
    assert c.fenced == ["node-a"]


def test_same_seq_with_different_payload_is_duplicate() -> None:
    c = RecordingConsumer()
    gate = make_gate(c)
    s = Stream()
    gate.ingest(s.store([key(1)], size=100, seq=1))
    assert gate.ingest(s.store([key(1)], size=999, seq=1)) is IngestResult.DUPLICATE
    assert len(c.batches) == 1


def test_replay_after_later_delete_is_duplicate() -> None:
    """Seq1 store, seq2 delete, replayed seq1 → DUPLICATE; 2 delivered."""
    c = RecordingConsumer()
    gate = make_gate(c)
    s = Stream()
    store = s.store([key(1)])
    gate.ingest(store)
    gate.ingest(s.delete([key(1)]))
    assert gate.ingest(store) is IngestResult.DUPLICATE
    assert len(c.batches) == 2


def test_out_of_order_older_seq_is_dropped_as_duplicate() -> None:
    """No reorder buffer — once seq 5 is in, seq 3 is a duplicate forever."""
    gate = make_gate()
    s = Stream()
    gate.ingest(s.store([key(1)], seq=5))
    assert gate.ingest(s.store([key(1)], seq=3)) is IngestResult.DUPLICATE


def test_seq_jump_sets_sticky_gap_but_admits() -> None:
    """Seq1 then seq5 → ADMITTED, gap flagged, last_seq 5; later seqs keep the flag."""
    c = RecordingConsumer()
    gate = make_gate(c)
    s = Stream()
    gate.ingest(s.store([key(1)], seq=1))
    assert gate.ingest(s.store([key(2)], seq=5)) is IngestResult.ADMITTED
    cur = gate.cursors()["node-a"]
    assert cur.gap_detected is True
    assert cur.last_seq == 5
    assert len(c.batches) == 2
    gate.ingest(s.store([key(3)], seq=6))
    assert gate.cursors()["node-a"].gap_detected is True


def test_consecutive_seqs_leave_no_gap() -> None:
    gate = make_gate()
    s = Stream()
    gate.ingest(s.store([key(1)]))
    gate.ingest(s.store([key(2)]))
    assert gate.cursors()["node-a"].gap_detected is False


def test_first_batch_after_cold_start_with_high_seq_is_a_gap() -> None:
    """A fresh cursor starts at last_seq 0, so a first seq > 1 is flagged."""
    gate = make_gate()
    gate.ingest(Stream().store([key(1)], seq=7))
    assert gate.cursors()["node-a"].gap_detected is True


def test_emitters_have_independent_cursors() -> None:
    gate = make_gate()
    assert gate.ingest(Stream("node-a").store([key(1)])) is IngestResult.ADMITTED
    assert gate.ingest(Stream("node-b").store([key(1)])) is IngestResult.ADMITTED
    assert set(gate.cursors()) == {"node-a", "node-b"}


def test_newer_incarnation_fences_before_admitting() -> None:
    """Inc2 after inc1 → ADMITTED, fenced first, cursor (inc 2, last_seq 1)."""
    log: list[tuple[str, str, object]] = []
    c = RecordingConsumer(log=log)
    gate = make_gate(c)
    gate.ingest(Stream(incarnation=1).store([key(1)], seq=4))
    log.clear()
    assert gate.ingest(Stream(incarnation=2).store([key(2)])) is IngestResult.ADMITTED
    assert log == [("rec", "fence", "node-a"), ("rec", "consume", 1)]
    cur = gate.cursors()["node-a"]
    assert (cur.incarnation, cur.last_seq, cur.gap_detected) == (2, 1, False)


def test_restart_removes_old_incarnation_l1_from_real_directory() -> None:
    """Inc1 stores k1, k2 in L1; inc2 stores k3 → k1, k2 gone, k3 at inc 2."""
    spaces = KeySpaces()
    directory = KeyDirectory(spaces)
    b = CacheEventBroadcaster()
    b.register(directory)
    gate = EventGate(b)
    gate.ingest(Stream(incarnation=1).store([key(1), key(2)]))
    gate.ingest(Stream(incarnation=2).store([key(3)]))
    k1, k2, k3 = directory.lookup([key(1), key(2), key(3)])
    assert k1.placements == ()
    assert k2.placements == ()
    assert [p.incarnation for p in k3.placements] == [2]


def test_restart_keeps_other_instances_placements() -> None:
    """Node-a and node-b hold k1; node-a restarts → only node-b's remains."""
    spaces = KeySpaces()
    directory = KeyDirectory(spaces)
    b = CacheEventBroadcaster()
    b.register(directory)
    gate = EventGate(b)
    gate.ingest(Stream("node-a").store([key(1)]))
    gate.ingest(Stream("node-b").store([key(1)]))
    gate.ingest(Stream("node-a", incarnation=2).store([key(9)]))
    (info,) = directory.lookup([key(1)])
    assert [p.instance_id for p in info.placements] == ["node-b"]


def test_older_incarnation_is_stale_without_delivery_or_fence() -> None:
    """After inc2/s1, inc1/s99 → STALE_INCARNATION, no delivery, no fence."""
    c = RecordingConsumer()
    gate = make_gate(c)
    gate.ingest(Stream(incarnation=2).store([key(1)]))
    c.batches.clear()
    assert (
        gate.ingest(Stream(incarnation=1).store([key(1)], seq=99)) is IngestResult.STALE_INCARNATION
    )
    assert c.batches == []
    assert c.fenced == []


def test_same_incarnation_never_fences() -> None:
    c = RecordingConsumer()
    gate = make_gate(c)
    s = Stream()
    for i in range(5):
        gate.ingest(s.store([key(i)]))
    assert c.fenced == []


def test_drop_instance_fences_and_forgets_cursor() -> None:
    """Drop after inc5/s9 fences, cursors empty, then inc1/s1 is ADMITTED."""
    c = RecordingConsumer()
    gate = make_gate(c)
    gate.ingest(Stream(incarnation=5).store([key(1)], seq=9))
    gate.drop_instance("node-a")
    assert c.fenced == ["node-a"]
    assert gate.cursors() == {}
    assert gate.ingest(Stream(incarnation=1).store([key(1)])) is IngestResult.ADMITTED


def test_drop_unknown_instance_is_harmless_but_still_fences() -> None:
    """Fencing fires even without a cursor."""
    c = RecordingConsumer()
    gate = make_gate(c)
    gate.drop_instance("ghost")
    assert gate.cursors() == {}
    assert c.fenced == ["ghost"]


def test_cursors_empty_before_any_event() -> None:
    assert make_gate().cursors() == {}


def test_consumer_failure_does_not_change_the_result() -> None:
    """A consumer that raises → still ADMITTED and the cursor advances."""
    gate = make_gate(RecordingConsumer(fail_consume=True))
    assert gate.ingest(Stream().store([key(1)])) is IngestResult.ADMITTED
    assert gate.cursors()["node-a"].last_seq == 1


def test_cursor_counters_track_admitted_duplicate_stale_and_admit_time() -> None:
    """Kvmesh: per-emitter counters exposed with the cursor."""
    wall = FakeClock(1700.0)
    gate = make_gate(wall=wall)
    s2 = Stream(incarnation=2)
    gate.ingest(s2.store([key(1)]))
    wall.advance(5)
    gate.ingest(s2.store([key(2)]))
    gate.ingest(s2.store([key(2)], seq=2))
    gate.ingest(Stream(incarnation=1).store([key(3)]))
    cur = gate.cursors()["node-a"]
    assert (cur.batches_admitted, cur.batches_duplicate, cur.batches_stale) == (2, 1, 1)
    assert cur.last_admit_time == 1705.0


def test_counters_survive_incarnation_change_and_reset_on_drop() -> None:
    """Kvmesh: counters are per emitter id; a new incarnation keeps them, drop_instance resets."""
    gate = make_gate()
    gate.ingest(Stream(incarnation=1).store([key(1)], seq=3))
    gate.ingest(Stream(incarnation=2).store([key(1)]))
    cur = gate.cursors()["node-a"]
    assert cur.batches_admitted == 2
    assert cur.incarnation_changes == 1
    assert cur.gap_detected is False  # the new cursor started clean
    gate.drop_instance("node-a")
    gate.ingest(Stream(incarnation=1).store([key(1)]))
    assert gate.cursors()["node-a"].batches_admitted == 1


def test_cursor_restore_requires_an_empty_gate() -> None:
    """Restore after an admit (or twice) is refused."""
    gate = make_gate()
    gate.ingest(Stream().store([key(1)]))
    state = gate.capture()
    with pytest.raises(ValueError, match="empty gate"):
        gate.restore(state)
    fresh = make_gate()
    fresh.restore(state)
    assert fresh.cursors()["node-a"].last_seq == 1
    with pytest.raises(ValueError, match="restored already"):
        fresh.restore(state)


def test_restore_accepts_lmcache_shaped_cursor_rows() -> None:
    """Rows ``(incarnation, last_seq, gap_detected)`` come back as lists from msgpack."""
    gate = make_gate()
    gate.restore({"cursors": {"node-a": [7, 12, True]}})
    cur = gate.cursors()["node-a"]
    assert (cur.incarnation, cur.last_seq, cur.gap_detected) == (7, 12, True)
    assert gate.ingest(Stream(incarnation=7).store([key(1)], seq=12)) is IngestResult.DUPLICATE


# -- QuiesceLock -------------------------------------------------


def test_applying_waits_while_a_capture_holds_the_quiesce() -> None:
    """An applying() that arrives during quiesced() waits for it."""
    q = QuiesceLock()
    entered = threading.Event()
    with q.quiesced(1.0):
        t = threading.Thread(target=lambda: (q.applying().__enter__(), entered.set()))
        t.start()
        assert not entered.wait(0.05)
    assert entered.wait(5.0)
    q._exit_apply()
    t.join(5.0)


def test_quiesce_waits_for_the_batch_in_flight() -> None:
    """Quiesced() returns only after the in-flight batch finished."""
    q = QuiesceLock()
    release = threading.Event()
    started = threading.Event()
    order: list[str] = []

    def batch() -> None:
        with q.applying():
            started.set()
            release.wait(5.0)
            order.append("batch done")

    t = threading.Thread(target=batch)
    t.start()
    assert started.wait(5.0)

    def capture() -> None:
        with q.quiesced(5.0):
            order.append("captured")

    c = threading.Thread(target=capture)
    c.start()
    assert wait_until(lambda: q._requested)
    release.set()
    t.join(5.0)
    c.join(5.0)
    assert order == ["batch done", "captured"]


def test_wedged_batch_times_out_the_quiesce_and_ingest_resumes() -> None:
    """Timeout error mentions "in flight"; afterwards batches flow again."""
    q = QuiesceLock()
    wedged = threading.Event()
    release = threading.Event()

    def batch() -> None:
        with q.applying():
            wedged.set()
            release.wait(5.0)

    t = threading.Thread(target=batch)
    t.start()
    assert wedged.wait(5.0)
    with pytest.raises(QuiesceTimeout, match="in flight") as info, q.quiesced(0.05):
        pass
    assert isinstance(info.value, TimeoutError)
    with q.applying():  # not parked: the request was withdrawn
        pass
    release.set()
    t.join(5.0)
    assert q.in_flight == 0


def test_ingest_during_a_slow_capture_does_not_deadlock() -> None:
    """The capture holds the cursors; the parked ingest is admitted after it."""
    gate = make_gate()
    gate.ingest(Stream().store([key(1)]))
    captured: list[object] = []
    done = threading.Event()

    def ingest() -> None:
        gate.ingest(Stream().store([key(2)], seq=2))
        done.set()

    with gate.quiesce.quiesced(5.0):
        t = threading.Thread(target=ingest)
        t.start()
        assert not done.wait(0.05)
        captured.append(gate.capture())
    assert done.wait(5.0)
    t.join(5.0)
    assert captured[0] == {"cursors": {"node-a": [1, 1, False, 1, 0, 0, 0, 1000.0]}}
    assert gate.cursors()["node-a"].last_seq == 2


def test_second_capturer_queues_behind_the_first() -> None:
    """Kvmesh: two concurrent quiesced() calls do not clear each other's request."""
    q = QuiesceLock()
    with q.quiesced(1.0), pytest.raises(QuiesceTimeout), q.quiesced(0.05):
        pass
    with q.quiesced(1.0):
        pass


def test_drop_instance_is_bracketed_by_the_quiesce() -> None:
    """Drop_instance takes applying(), so it parks during a capture."""
    c = RecordingConsumer()
    gate = make_gate(c)
    done = threading.Event()
    with gate.quiesce.quiesced(5.0):
        t = threading.Thread(target=lambda: (gate.drop_instance("x"), done.set()))
        t.start()
        assert not done.wait(0.05)
        assert c.fenced == []
    assert done.wait(5.0)
    t.join(5.0)
    assert c.fenced == ["x"]


def test_tier_is_irrelevant_to_admission() -> None:
    """Admission looks at instance, incarnation and seq only."""
    gate = make_gate()
    s = Stream()
    assert gate.ingest(s.store([key(1)], tier=Tier.L2)) is IngestResult.ADMITTED
    assert gate.ingest(s.access([key(1)])) is IngestResult.ADMITTED
