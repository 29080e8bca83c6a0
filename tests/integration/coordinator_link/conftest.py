"""Fixtures of the storage ↔ coordinator link tests: a fake coordinator on a real socket."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from tests.harness import ServerThread, free_port, server_thread, wait_for
from tests.integration.coordinator_link.fake_coordinator import CoordinatorHandle, FakeCoordinator


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[ServerThread]:
    """One event loop thread hosting every fake coordinator of these tests."""
    with server_thread() as thread:
        yield thread


@pytest.fixture
def coordinator_handle(loop_thread: ServerThread) -> Iterator[CoordinatorHandle]:
    """A fake coordinator on a fixed free port, not started yet."""
    handle = CoordinatorHandle(loop_thread, free_port(), FakeCoordinator())
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def coordinator(coordinator_handle: CoordinatorHandle) -> CoordinatorHandle:
    """A serving fake coordinator."""
    coordinator_handle.start()
    return coordinator_handle


@pytest.fixture
def no_new_threads() -> Callable[[], None]:
    """Call the yielded function to assert every thread started since the test began has ended."""
    before = set(threading.enumerate())

    def check() -> None:
        def extra() -> list[threading.Thread]:
            return [t for t in threading.enumerate() if t not in before and t.is_alive()]

        try:
            wait_for(lambda: not extra(), timeout=10.0)
        except AssertionError:
            raise AssertionError(f"threads still running: {[t.name for t in extra()]}") from None

    return check
