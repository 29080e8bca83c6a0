"""Fixtures of the storage ↔ coordinator link tests: a fake coordinator on a real socket."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from tests.support.fake_coordinator import CoordinatorHandle, FakeCoordinator
from tests.support.harness import ServerThread, no_thread_left_since, server_thread
from tests.support.ports import free_port


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
    return lambda: no_thread_left_since(before)
