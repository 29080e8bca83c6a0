"""Waiting on a condition with a deadline: the one polling helper every test uses.

Tests never sleep for a fixed time to let something happen; they poll a
condition until it holds and fail with a clear message when the deadline
passes. The deadline is generous (these machines have two shared cores): it
bounds a hang, it does not time anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.01,
    message: str | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that value.

    Raises AssertionError (failing the test) when ``timeout`` seconds pass first;
    the predicate is tried once more at the deadline, so a condition that became
    true while the last interval ran is not reported as a timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            value = predicate()
            if value:
                return value
            raise AssertionError(message or f"condition not met within {timeout} s")
        time.sleep(interval)
