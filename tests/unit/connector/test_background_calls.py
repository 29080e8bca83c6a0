"""``BackgroundCalls``: the scheduler's calls that it does not wait for."""

from __future__ import annotations

import logging
import threading

import pytest

from kvmesh.connector.background import BackgroundCalls


def test_calls_run_in_order_on_a_thread_of_their_own() -> None:
    calls = BackgroundCalls("test-calls")
    ran: list[tuple[int, str]] = []
    for i in range(50):
        calls.submit(f"r{i % 3}", lambda i=i: ran.append((i, threading.current_thread().name)))
    calls.close()
    assert [i for i, _ in ran] == list(range(50))
    assert {name for _, name in ran} == {"test-calls"}


def test_submit_returns_before_the_call_runs_and_wait_for_waits_for_its_key_only() -> None:
    calls = BackgroundCalls("test-calls")
    gate = threading.Event()
    calls.submit("slow", lambda: gate.wait(30))
    calls.submit("slow", lambda: None)
    assert calls.wait_for("other", timeout=5) is True  # nothing queued under it
    assert calls.wait_for("slow", timeout=0.05) is False
    gate.set()
    assert calls.wait_for("slow", timeout=10) is True
    calls.close()


def test_a_failing_call_is_logged_and_later_calls_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = BackgroundCalls("test-calls")
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("gateway gone")

    with caplog.at_level(logging.ERROR, logger="kvmesh.connector.background"):
        calls.submit("r1", boom)
        calls.submit("r2", lambda: ran.append("r2"))
        assert calls.wait_for("r2", timeout=10)
    calls.close()
    assert ran == ["r2"]
    assert "test-calls: call for r1 failed" in caplog.text


def test_close_runs_what_is_queued_and_later_calls_run_in_the_caller() -> None:
    calls = BackgroundCalls("test-calls")
    ran: list[str] = []
    for key in ("a", "b"):
        calls.submit(key, lambda key=key: ran.append(key))
    calls.close()
    assert ran == ["a", "b"]
    calls.submit("c", lambda: ran.append(threading.current_thread().name))
    assert ran == ["a", "b", threading.current_thread().name]
