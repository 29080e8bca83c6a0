"""A copy never starts once its caller has (nearly) given up on the call.

An engine whose Store or Retrieve passed its deadline recomputes those blocks,
or hands them to another request: a copy that started later would write into
(or store from) memory that is no longer the call's. The copier checks the
served call's deadline on the copy thread, after any wait for a free one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh.common.deadlines import CALL_DEADLINE, COPY_START_MARGIN_S
from kvmesh.common.errors import DeadlineExceeded
from kvmesh.storage.core.copies import ChunkCopier


def _copier(pool: ThreadPoolExecutor) -> ChunkCopier:
    return ChunkCopier(None, None, pool)  # type: ignore[arg-type]  # run() needs neither


def test_a_copy_runs_when_its_caller_still_waits_long_enough() -> None:
    copied: list[int] = []

    async def call() -> None:
        CALL_DEADLINE.set(time.monotonic() + COPY_START_MARGIN_S + 5)
        await _copier(pool).run(lambda: copied.append(1))

    with ThreadPoolExecutor(1) as pool:
        asyncio.run(call())
    assert copied == [1]


def test_a_copy_queued_past_its_callers_deadline_never_starts() -> None:
    copied: list[int] = []
    release = threading.Event()

    async def call() -> None:
        copier = _copier(pool)
        busy = asyncio.ensure_future(copier.run(lambda: release.wait(10)))  # no deadline
        CALL_DEADLINE.set(time.monotonic() + COPY_START_MARGIN_S + 0.2)
        late = asyncio.ensure_future(copier.run(lambda: copied.append(1)))
        await asyncio.sleep(0.4)  # the only copy thread is busy past the deadline
        release.set()
        await busy
        with pytest.raises(DeadlineExceeded, match="not started") as info:
            await late
        assert info.value.reason == "COPY_NOT_STARTED"

    with ThreadPoolExecutor(1) as pool:
        asyncio.run(call())
    assert copied == []


def test_a_call_without_a_deadline_always_copies() -> None:
    copied: list[int] = []

    async def call() -> None:
        await _copier(pool).run(lambda: copied.append(1))

    with ThreadPoolExecutor(1) as pool:
        asyncio.run(call())
    assert copied == [1]
