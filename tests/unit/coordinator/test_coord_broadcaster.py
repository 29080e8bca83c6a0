"""CacheEventBroadcaster (docs/coordinator.md, "Broadcaster")."""

from __future__ import annotations

import logging

import pytest

from kvmesh.coordinator.core import CacheEventBroadcaster
from tests.unit.coordinator.coord_testkit import RecordingConsumer, Stream, key


def test_batches_and_fences_reach_consumers_in_registration_order() -> None:
    log: list[tuple[str, str, object]] = []
    b = CacheEventBroadcaster()
    for name in ("first", "second", "third"):
        b.register(RecordingConsumer(name, log=log), name=name)
    b.broadcast(Stream().store([key(1)]))
    b.fence_instance("node-a")
    assert log == [
        ("first", "consume", 1),
        ("second", "consume", 1),
        ("third", "consume", 1),
        ("first", "fence", "node-a"),
        ("second", "fence", "node-a"),
        ("third", "fence", "node-a"),
    ]


def test_broadcast_and_fence_without_consumers_do_nothing() -> None:
    b = CacheEventBroadcaster()
    b.broadcast(Stream().store([key(1)]))
    b.fence_instance("node-a")
    assert b.stats() == {}


def test_late_consumer_sees_only_later_batches() -> None:
    b = CacheEventBroadcaster()
    s = Stream()
    b.broadcast(s.store([key(1)]))
    late = RecordingConsumer()
    b.register(late)
    second = s.store([key(2)])
    b.broadcast(second)
    assert late.batches == [second]


def test_failing_consumer_is_logged_and_later_consumers_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Consume and fence failures are logged with context and isolated."""
    b = CacheEventBroadcaster()
    bad = RecordingConsumer("bad", fail_consume=True, fail_fence=True)
    good = RecordingConsumer("good")
    b.register(bad, name="X")
    b.register(good)
    batch = Stream().store([key(1)])
    with caplog.at_level(logging.ERROR):
        b.broadcast(batch)
        b.fence_instance("node-a")
    assert "Cache-event consumer X failed on batch node-a/1/1" in caplog.text
    assert "Cache-event consumer X failed to fence node-a" in caplog.text
    assert good.batches == [batch]
    assert good.fenced == ["node-a"]


def test_stats_list_every_consumer_from_registration() -> None:
    """Delivered / failures / apply time per consumer, zeros before any batch."""
    b = CacheEventBroadcaster()
    b.register(RecordingConsumer())
    b.register(RecordingConsumer(fail_consume=True, fail_fence=True), name="flaky")
    before = b.stats()
    assert set(before) == {"RecordingConsumer", "flaky"}
    assert before["flaky"].batches_delivered == 0
    assert before["flaky"].apply_seconds == 0.0
    b.broadcast(Stream().store([key(1)]))
    b.fence_instance("node-a")
    after = b.stats()
    assert after["RecordingConsumer"].batches_delivered == 1
    assert after["flaky"].consume_failures == 1
    assert after["flaky"].fence_failures == 1
    assert after["flaky"].batches_delivered == 0
    assert after["RecordingConsumer"].apply_seconds >= 0.0


def test_repeated_names_get_a_suffix_and_non_consumers_are_refused() -> None:
    """Kvmesh: stats keys stay unique; a registration without the hooks is a TypeError."""
    b = CacheEventBroadcaster()
    assert b.register(RecordingConsumer()) == "RecordingConsumer"
    assert b.register(RecordingConsumer()) == "RecordingConsumer#2"
    assert b.consumer_names == ("RecordingConsumer", "RecordingConsumer#2")
    with pytest.raises(TypeError):
        b.register(object())  # type: ignore[arg-type]
