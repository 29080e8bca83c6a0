"""The incarnation counter: strictly growing on every start, whatever the clock does."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from kvmesh.storage.core.incarnation import INCARNATION_FILE, next_incarnation, read_incarnation


class FakeClock:
    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


def test_counter_grows_on_every_start_even_within_one_clock_tick(tmp_path: Path) -> None:
    clock = FakeClock(1_000)

    values = [next_incarnation(tmp_path, clock_ns=clock) for _ in range(3)]

    assert values == [1_000, 1_001, 1_002]
    assert read_incarnation(tmp_path) == 1_002


def test_counter_grows_when_the_clock_goes_backwards(tmp_path: Path) -> None:
    clock = FakeClock(5_000)
    first = next_incarnation(tmp_path, clock_ns=clock)
    clock.now_ns = 10

    assert next_incarnation(tmp_path, clock_ns=clock) == first + 1


def test_counter_follows_the_clock_when_it_moves_ahead(tmp_path: Path) -> None:
    clock = FakeClock(5_000)
    next_incarnation(tmp_path, clock_ns=clock)
    clock.now_ns = 9_000_000

    assert next_incarnation(tmp_path, clock_ns=clock) == 9_000_000


def test_a_lost_state_file_still_beats_the_previous_incarnation(tmp_path: Path) -> None:
    clock = FakeClock(5_000)
    before = next_incarnation(tmp_path / "old-volume", clock_ns=clock)
    clock.now_ns += 1

    assert next_incarnation(tmp_path / "fresh-volume", clock_ns=clock) > before


def test_state_dir_is_created_and_no_temporary_file_is_left(tmp_path: Path) -> None:
    state = tmp_path / "a" / "b"

    value = next_incarnation(state, clock_ns=FakeClock(42))

    assert (state / INCARNATION_FILE).read_text() == f"{value}\n"
    assert [p.name for p in state.iterdir() if p.name.endswith(".tmp")] == []


def test_an_unreadable_file_falls_back_to_the_clock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / INCARNATION_FILE).write_text("garbage")

    assert next_incarnation(tmp_path, clock_ns=FakeClock(777)) == 777
    assert "unreadable incarnation file" in caplog.text
    assert read_incarnation(tmp_path) == 777


def test_without_a_state_dir_the_time_based_value_still_grows() -> None:
    clock = FakeClock(10**18)
    first = next_incarnation(None, clock_ns=clock)
    second = next_incarnation(None, clock_ns=clock)
    clock.now_ns = 10**18 - 10**12  # the clock stepped back
    third = next_incarnation(None, clock_ns=clock)

    assert first < second < third


def test_the_default_clock_is_wall_time_in_nanoseconds(tmp_path: Path) -> None:
    import time

    before = time.time_ns()
    assert next_incarnation(tmp_path) >= before
    assert next_incarnation(None) >= before


def _start_many(state_dir: str, count: int, out: multiprocessing.Queue[int]) -> None:
    for _ in range(count):
        out.put(next_incarnation(Path(state_dir), clock_ns=lambda: 1))


def test_concurrent_starts_sharing_a_state_dir_never_get_the_same_value(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[int] = ctx.Queue()
    procs = [ctx.Process(target=_start_many, args=(str(tmp_path), 10, out)) for _ in range(4)]
    for p in procs:
        p.start()
    values = [out.get(timeout=30) for _ in range(40)]
    for p in procs:
        p.join(30)

    assert sorted(values) == list(range(1, 41))
    assert read_incarnation(tmp_path) == 40
