"""kvmesh: when the core asks a node to resync (core.resync), and the ledger of node commands.

The planner's triggers (see the module docstring of ``core.resync``): a seq
gap (rate-limited inside an incarnation, at once on a fresh cursor), a node
dropped while it lives on (its next batch is a fresh-cursor gap), an
unknown emitter opening its stream (which covers its first fresh cursor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core import Coordinator, CoordinatorSettings
from kvmesh.coordinator.core.commands import UNKNOWN_KIND, CommandLedger
from kvmesh.coordinator.core.resync import ResyncPlanner
from tests.unit.coordinator.coord_testkit import FakeClock, Stream, key


@dataclass
class Dispatcher:
    """Records deletes and resyncs; ``accept`` decides whether the node's stream takes them."""

    accept: bool = True
    resyncs: list[str] = field(default_factory=list)
    deletes: list[tuple[str, Tier, str]] = field(default_factory=list)

    def dispatch_resync(self, instance_id: str) -> bool:
        self.resyncs.append(instance_id)
        return self.accept

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> str:
        self.deletes.append((instance_id, tier, backend))
        return f"cmd-{len(self.deletes)}" if self.accept else ""


def planner(min_interval: float = 30.0) -> tuple[ResyncPlanner, Dispatcher, FakeClock]:
    clock = FakeClock()
    d = Dispatcher()
    return ResyncPlanner(dispatcher=d, min_interval=min_interval, clock=clock), d, clock


# -- planner -------------------------------------------------------------------------------


def test_a_gap_inside_an_incarnation_asks_once_per_interval_and_the_rest_later() -> None:
    p, d, clock = planner(min_interval=30.0)
    p.cursor_event("node-a", False, True)
    assert d.resyncs == ["node-a"]
    p.cursor_event("node-a", False, True)  # the window keeps overflowing: held back
    p.cursor_event("node-a", False, True)
    assert d.resyncs == ["node-a"]
    assert p.tick() == 0
    clock.advance(30.0)
    assert p.tick() == 1  # the held-back gaps, folded into one
    assert p.tick() == 0
    assert d.resyncs == ["node-a", "node-a"]
    assert (p.stats().requested, p.stats().held_back, p.stats().pending) == (2, 2, 0)


def test_a_fresh_cursor_with_a_gap_asks_at_once_and_one_without_does_not() -> None:
    p, d, _ = planner()
    p.cursor_event("node-a", True, False)  # seq 1 of a new emitter
    p.cursor_event("node-a", False, True)
    p.cursor_event("node-a", True, True)  # e.g. dropped, then its next batch
    assert d.resyncs == ["node-a", "node-a"]


def test_an_unknown_stream_open_covers_its_first_fresh_cursor_but_not_after_a_drop() -> None:
    p, d, _ = planner()
    assert not p.stream_opened("node-a", known=True)
    assert p.stream_opened("node-a", known=False)
    p.cursor_event("node-a", True, True)  # the resync asked at the open covers it
    assert d.resyncs == ["node-a"]
    assert p.stream_opened("node-b", known=False)
    p.instance_dropped("node-b")  # fenced after that resync was asked: it covers nothing
    p.cursor_event("node-b", True, True)
    assert d.resyncs == ["node-a", "node-b", "node-b"]


def test_a_resync_no_stream_took_is_retried_at_the_next_tick() -> None:
    p, d, _ = planner()
    d.accept = False
    p.cursor_event("node-a", True, True)
    assert p.stats().pending == 1
    assert p.tick() == 0
    d.accept = True
    assert p.tick() == 1
    assert d.resyncs == ["node-a"] * 3
    assert p.stats().pending == 0
    p.instance_dropped("node-a")  # a drop forgets what was owed: the next batch asks again
    d.accept = False
    p.cursor_event("node-a", True, True)
    p.instance_dropped("node-a")
    assert p.stats().pending == 0


def test_a_resync_asked_elsewhere_covers_the_first_fresh_cursor() -> None:
    p, d, _ = planner()
    p.note_requested("node-a")  # the NATS source asked an emitter first seen past seq 1
    p.cursor_event("node-a", True, True)
    assert d.resyncs == []
    assert p.stats().requested == 1


# -- through the coordinator ------------------------------------------------------------------


def make(d: Dispatcher) -> Coordinator:
    return Coordinator(
        CoordinatorSettings(heartbeat_interval=0.1, resync_min_interval=30.0), dispatcher=d
    )


def test_a_node_dropped_while_alive_is_asked_to_resync_at_its_next_batch() -> None:
    d = Dispatcher()
    c = make(d)
    s = Stream("node-a")
    c.register_instance("node-a")
    c.ingest(s.store([key(1), key(2)]))
    c.ingest(s.store([key(3)], tier=Tier.L2))
    assert d.resyncs == []
    c.deregister_instance("node-a")  # or a heartbeat timeout: L1 fenced, cursor forgotten
    assert [p.tier for p in c.lookup([key(1)])[0].placements] == []
    c.register_instance("node-a")
    c.ingest(s.store([key(4)]))  # seq 3 on a fresh cursor: the hole the drop left
    assert d.resyncs == ["node-a"]
    assert c.cursors()["node-a"].gap_detected


def test_a_gap_inside_an_incarnation_asks_for_a_resync_and_keeps_its_placements() -> None:
    d = Dispatcher()
    c = make(d)
    s = Stream("node-a")
    c.ingest(s.store([key(1)]))
    s.seq += 3  # three batches lost (the node's window overflowed)
    c.ingest(s.store([key(2)]))
    assert d.resyncs == ["node-a"]
    assert all(info.placements for info in c.lookup([key(1), key(2)]))


def test_a_stream_opened_by_an_unknown_emitter_asks_once() -> None:
    d = Dispatcher()
    c = make(d)
    assert c.stream_opened("node-a")
    c.ingest(Stream("node-a", seq=6).store([key(1)]))  # its resent batch, seq 7
    assert d.resyncs == ["node-a"]
    assert not c.stream_opened("node-a")  # known now


def test_the_coordinator_without_a_resync_dispatcher_asks_nobody() -> None:
    c = Coordinator(CoordinatorSettings())
    c.ingest(Stream("node-a", seq=4).store([key(1)]))
    assert not c.stream_opened("node-b")
    assert c.resync.stats().requested == 0


# -- the ledger ----------------------------------------------------------------------------


def test_the_ledger_counts_answers_by_command_and_result_and_keeps_refusals() -> None:
    now = [100.0]
    ledger = CommandLedger(keep_failures=2, wall_clock=lambda: now[0])
    ledger.sent("c1", "node-a", "delete_keys", "L1 dram, 2 keys")
    ledger.sent("c2", "node-a", "delete_keys", "L2 disk, 1 keys")
    ledger.sent("c3", "node-b", "resync", "L1")
    assert ledger.awaiting() == 3
    ledger.answered("node-a", "c1", "OK", affected=2)
    now[0] = 101.0
    refused = ledger.answered("node-a", "c2", "INVALID_ARGUMENT", "unknown L2 backend 'disk'")
    assert (refused.kind, refused.summary, refused.ok) == ("delete_keys", "L2 disk, 1 keys", False)
    ledger.answered("node-b", "c9", "INTERNAL", "boom")  # a command this ledger never saw
    assert ledger.result_counts() == {
        ("delete_keys", "OK"): 1,
        ("delete_keys", "INVALID_ARGUMENT"): 1,
        (UNKNOWN_KIND, "INTERNAL"): 1,
    }
    assert [f.command_id for f in ledger.recent_failures()] == ["c9", "c2"]  # newest first
    assert ledger.recent_failures()[1].answered_at == 101.0
    assert ledger.awaiting() == 1  # c3
    assert ledger.sent_total() == 3


def test_the_ledger_waits_for_answers_up_to_its_timeout() -> None:
    ledger = CommandLedger()
    ledger.sent("c1", "node-a", "delete_keys")
    ledger.sent("c2", "node-a", "delete_keys")
    ledger.answered("node-a", "c1", "OK", affected=3)
    got = ledger.wait(["c1", "c2", ""], timeout=0.0)
    assert list(got) == ["c1"]
    assert got["c1"].affected == 3
    ledger.answered("node-a", "c2", "NOT_FOUND", "gone")
    assert set(ledger.wait(["c1", "c2"], timeout=0.0)) == {"c1", "c2"}
    assert ledger.outcome("c2") is not None
    assert ledger.outcome("c3") is None
