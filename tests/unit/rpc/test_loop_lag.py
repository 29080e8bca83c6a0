"""The event-loop lag monitor: what it records, when it warns, how it starts and stops."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.common.config import ConfigError
from kvmesh.rpc.loop_lag import LAG_BUCKETS, LoopLagMonitor
from kvmesh.rpc.server import ServerSettings


def _bucket(registry: CollectorRegistry, le: float) -> float:
    value = registry.get_sample_value(
        "kvmesh_event_loop_lag_seconds_bucket", {"service": "svc", "le": str(le)}
    )
    assert value is not None
    return value


def _count(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value("kvmesh_event_loop_lag_seconds_count", {"service": "svc"})
    assert value is not None
    return value


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_callback_that_holds_the_loop_is_recorded_as_a_late_wake_up() -> None:
    registry = CollectorRegistry()

    async def scenario() -> None:
        monitor = LoopLagMonitor(registry, "svc", interval_s=0.005)
        monitor.start()
        monitor.start()  # a second start keeps the one task
        await asyncio.sleep(0.03)
        time.sleep(0.12)  # holds the loop: the monitor's timer was due long ago
        await asyncio.sleep(0.03)
        await monitor.stop()
        await monitor.stop()  # stopping twice is harmless

    asyncio.run(scenario())
    # The stall of 120 ms shows as at least 115 ms (less up to one interval).
    assert _count(registry) - _bucket(registry, 0.1) >= 1
    assert _count(registry) >= 2  # it also woke on time around the stall


def test_stop_ends_the_task_and_nothing_more_is_recorded() -> None:
    registry = CollectorRegistry()

    async def scenario() -> float:
        monitor = LoopLagMonitor(registry, "svc", interval_s=0.002)
        await monitor.stop()  # never started: nothing to do
        monitor.start()
        await asyncio.sleep(0.02)
        await monitor.stop()
        seen = _count(registry)
        await asyncio.sleep(0.02)
        assert not [t for t in asyncio.all_tasks() if "kvmesh-loop-lag" in t.get_name()]
        return seen

    seen = asyncio.run(scenario())
    assert seen >= 1
    assert _count(registry) == seen


def test_the_buckets_include_the_20_ms_line() -> None:
    assert 0.02 in LAG_BUCKETS
    assert list(LAG_BUCKETS) == sorted(LAG_BUCKETS)


def test_a_stall_of_a_second_warns_once_a_minute_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    monitor = LoopLagMonitor(CollectorRegistry(), "svc", warn_s=1.0, warn_every_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvmesh.rpc.loop_lag"):
        monitor.observe(0.9)  # below the line: recorded, not logged
        assert not caplog.records
        monitor.observe(1.5)
        assert len(caplog.records) == 1
        assert "stalled for 1.50 s" in caplog.records[0].getMessage()
        clock.now += 10
        monitor.observe(2.0)
        clock.now += 10
        monitor.observe(1.1)
        assert len(caplog.records) == 1  # within the minute: counted, not logged
        clock.now += 45
        monitor.observe(1.2)
    assert len(caplog.records) == 2
    message = caplog.records[1].getMessage()
    assert "3 times" in message
    assert "the longest 2.00 s" in message


def test_observations_land_in_the_histogram() -> None:
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, "svc", clock=FakeClock())
    for lag in (0.0, 0.003, 0.03, 0.3):
        monitor.observe(lag)
    assert _count(registry) == 4
    assert _bucket(registry, 0.005) == 2
    assert _bucket(registry, 0.05) == 3
    assert _bucket(registry, 0.5) == 4


@pytest.mark.parametrize("interval", [0.0, -0.01])
def test_a_non_positive_interval_is_refused(interval: float) -> None:
    with pytest.raises(ValueError, match="interval_s must be positive"):
        LoopLagMonitor(CollectorRegistry(), "svc", interval_s=interval)


@pytest.mark.parametrize("interval_ms", [-1.0, 0.5, 60_001.0])
def test_a_service_refuses_a_loop_lag_interval_out_of_range(interval_ms: float) -> None:
    with pytest.raises(ConfigError, match="loop_lag_interval_ms must be 0"):
        ServerSettings(loop_lag_interval_ms=interval_ms).validate_server()


@pytest.mark.parametrize("interval_ms", [0.0, 1.0, 50.0, 60_000.0])
def test_a_service_takes_a_loop_lag_interval_in_range_or_zero(interval_ms: float) -> None:
    ServerSettings(loop_lag_interval_ms=interval_ms).validate_server()
