"""State of ids that are neither registered nor heard from (docs/coordinator.md, "Membership").

A checkpoint brings back cursors, capacity and L1 placements of every node
that sent events before it; a node that never comes back (replaced under a
new id while the coordinator was down) used to keep them forever, and
routers and peers were sent to its chunks.
"""

from __future__ import annotations

from pathlib import Path

from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core import Coordinator, CoordinatorSettings
from tests.support.waiting import wait_until
from tests.unit.coordinator.coord_testkit import FakeClock, Stream, key

TIMEOUT = 30.0


def settings(tmp: Path | None = None) -> CoordinatorSettings:
    return CoordinatorSettings(
        instance_timeout=TIMEOUT,
        health_check_interval=0,
        eviction_check_interval=0,
        checkpoint_path=str(tmp / "ckpt.bin") if tmp is not None else "",
    )


def holders(c: Coordinator, k: ObjectKey) -> list[str]:
    (info,) = c.lookup([k])
    return sorted({p.instance_id for p in info.placements})


def checkpointed_fleet(tmp: Path) -> None:
    """node-a and node-b each hold one L1 key, declare capacity, and are saved."""
    c = Coordinator(settings(tmp))
    for n, name in enumerate(("node-a", "node-b"), start=1):
        c.register_instance(name)
        s = Stream(name)
        c.ingest(s.config(Tier.L1, "dram", 1 << 30, 1))
        c.ingest(s.store([key(n)], size=100))
    assert c.checkpoint_now().ok is True


def test_a_restored_node_that_never_returns_is_dropped_after_the_timeout(tmp_path: Path) -> None:
    checkpointed_fleet(tmp_path)
    clock = FakeClock()
    c = Coordinator(settings(tmp_path), clock=clock)
    assert c.load_state() is not None
    assert holders(c, key(1)) == ["node-a"]
    c.register_instance("node-b")  # node-b comes back; node-a was replaced
    clock.advance(TIMEOUT)
    assert c.sweep_unregistered() == []  # not yet: "more than" the timeout
    clock.advance(1)
    assert c.sweep_unregistered() == ["node-a"]
    assert holders(c, key(1)) == []
    assert "node-a" not in c.cursors()
    assert c.capacity.get("node-a") == ()
    assert c.usage.get_bytes_by_instance(Tier.L1).get("node-a", {}) == {}
    # The node that re-registered keeps everything, though it sent nothing.
    assert holders(c, key(2)) == ["node-b"]
    assert c.cursors()["node-b"].last_seq == 2
    assert c.capacity.get("node-b")[0].capacity_bytes == 1 << 30
    assert c.sweep_unregistered() == []


def test_an_unregistered_emitter_keeps_its_state_while_it_sends() -> None:
    """A tool feeding IngestBatches without registering: each batch counts as heard."""
    clock = FakeClock()
    c = Coordinator(settings(), clock=clock)
    s = Stream("tool")
    for n in range(4):
        c.ingest(s.store([key(n)], size=10))
        clock.advance(TIMEOUT * 0.75)
        assert c.sweep_unregistered() == []
    # A repeat of an old batch (a resend) is heard too.
    c.ingest(s.store([key(9)], seq=1))
    clock.advance(TIMEOUT * 0.75)
    assert c.sweep_unregistered() == []
    assert holders(c, key(0)) == ["tool"]
    clock.advance(TIMEOUT * 0.5)
    assert c.sweep_unregistered() == ["tool"]
    assert [holders(c, key(n)) for n in range(4)] == [[], [], [], []]


def test_an_event_after_deregistration_does_not_leave_placements_forever() -> None:
    clock = FakeClock()
    c = Coordinator(settings(), clock=clock)
    c.register_instance("node-a")
    s = Stream("node-a")
    c.ingest(s.store([key(1)], size=10))
    assert c.deregister_instance("node-a") is True
    c.ingest(s.store([key(2)], size=10))  # in flight when the node deregistered
    assert holders(c, key(2)) == ["node-a"]
    clock.advance(TIMEOUT + 1)
    assert c.sweep_unregistered() == ["node-a"]
    assert holders(c, key(2)) == []
    assert c.cursors() == {}


def test_held_state_without_a_cursor_counts_from_the_coordinators_start(tmp_path: Path) -> None:
    """A checkpoint whose cursor section is gone still restores placements and capacity."""
    checkpointed_fleet(tmp_path)
    clock = FakeClock()
    c = Coordinator(settings(), clock=clock)
    saved = Coordinator(settings(tmp_path))
    saved.load_state()
    c.directory.restore(saved.directory.capture())
    c.capacity.restore(saved.capacity.capture())
    assert c.cursors() == {}
    assert holders(c, key(1)) == ["node-a"]
    clock.advance(TIMEOUT)
    assert c.sweep_unregistered() == []
    clock.advance(1)
    assert c.sweep_unregistered() == ["node-a", "node-b"]
    assert holders(c, key(1)) == holders(c, key(2)) == []
    assert c.capacity.get_all() == {}


def test_the_timeout_counts_from_when_the_coordinator_starts_serving(tmp_path: Path) -> None:
    """A slow checkpoint load does not eat into a live node's time to re-register."""
    checkpointed_fleet(tmp_path)
    clock = FakeClock()
    c = Coordinator(settings(tmp_path), clock=clock)
    assert c.load_state() is not None
    clock.advance(TIMEOUT * 2)  # the load took long
    c.start()
    try:
        clock.advance(TIMEOUT)
        assert c.sweep_unregistered() == []
        assert holders(c, key(1)) == ["node-a"]
        clock.advance(1)
        assert c.sweep_unregistered() == ["node-a", "node-b"]
    finally:
        c.stop()


def test_shared_l1_pools_are_no_nodes_state() -> None:
    """Usage of a shared L1 pool is owned by no node: never swept, never warned about."""
    clock = FakeClock()
    c = Coordinator(settings(), clock=clock)
    c.register_instance("node-a")
    c.ingest(Stream("node-a").store([key(1)], size=10, shared=True))
    assert "" in c.usage.get_bytes_by_instance(Tier.L1)
    clock.advance(TIMEOUT * 10)
    assert c.sweep_unregistered() == []
    assert c.list_quota_status(Tier.L1).total_bytes == 10


def test_a_registered_node_is_never_swept_here_however_quiet() -> None:
    """Registered nodes are the heartbeat sweep's, not this one's."""
    clock = FakeClock()
    c = Coordinator(settings(), clock=clock)
    c.register_instance("node-a")
    c.ingest(Stream("node-a").store([key(1)], size=10))
    clock.advance(TIMEOUT * 10)
    assert c.sweep_unregistered() == []
    assert holders(c, key(1)) == ["node-a"]


def test_the_health_timer_drops_a_quiet_unregistered_emitter() -> None:
    """On the core's own timer, with a short timeout."""
    c = Coordinator(
        CoordinatorSettings(
            instance_timeout=0.05, health_check_interval=0.02, eviction_check_interval=0
        )
    )
    c.start()
    try:
        c.ingest(Stream("gone").store([key(1)], size=10))
        assert wait_until(lambda: holders(c, key(1)) == [])
        assert c.cursors() == {}
    finally:
        c.stop()
