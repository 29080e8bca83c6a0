"""``lower_this_thread``: background threads run at a higher nice value, alone."""

from __future__ import annotations

import os
import tempfile
import threading

import pytest

from kvmesh.common.thread_priority import BACKGROUND_NICENESS, lower_this_thread
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs setpriority")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_only_the_calling_thread_is_lowered() -> None:
    main_before = _nice(threading.get_native_id())
    seen: dict[str, int] = {}

    def background() -> None:
        seen["before"] = _nice(threading.get_native_id())
        seen["ok"] = lower_this_thread()
        seen["after"] = _nice(threading.get_native_id())

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["ok"] is True
    assert seen["after"] == min(19, seen["before"] + BACKGROUND_NICENESS)
    assert _nice(threading.get_native_id()) == main_before


def test_the_l2_write_through_threads_run_lowered() -> None:
    from kvmesh.storage.core.controllers.store import StoreController

    base = _nice(threading.get_native_id())
    # One stand-in tier: the controller only starts its threads here, nothing is written.
    controller = StoreController(l1=None, tiers=[object()])  # type: ignore[arg-type, list-item]
    controller.start()
    try:
        put = controller._io.submit(lambda: _nice(threading.get_native_id())).result(10)
        (dispatcher,) = [t for t in threading.enumerate() if t.name == "kvmesh-l2-store"]
        tid = dispatcher.native_id
        assert tid is not None
        wait_until(lambda: _nice(tid) == min(19, base + BACKGROUND_NICENESS))
        assert put == min(19, base + BACKGROUND_NICENESS)
    finally:
        controller.close()


def test_the_l1_growth_thread_runs_lowered() -> None:
    from kvmesh.storage.core.l1.pool import L1Pool

    base = _nice(threading.get_native_id())
    shm = tempfile.mkdtemp(
        prefix="kvmesh-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    pool = L1Pool("nice", 8 << 20, segment_bytes=4 << 20, shm_dir=shm, initial_bytes=4 << 20)
    try:
        (grower,) = [t for t in threading.enumerate() if t.name == f"{pool.prefix}-grow"]
        tid = grower.native_id
        assert tid is not None
        wait_until(lambda: _nice(tid) == min(19, base + BACKGROUND_NICENESS))
        assert _nice(threading.get_native_id()) == base  # the caller keeps its own
    finally:
        pool.close()
        os.rmdir(shm)
