"""Thread priorities: background threads at a higher nice value, serving threads in real time.

``lower_this_thread`` lowers the calling thread alone. ``SCHED_FIFO`` (a node's
``realtime_priority``) applies to the threads set, never to the threads they
start; the copy kernel's helpers take their caller's policy.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest

from kvmesh.common.thread_priority import (
    BACKGROUND_NICENESS,
    lower_this_thread,
    realtime_initializer,
    serve_this_thread_in_realtime,
)
from tests.support.waiting import wait_until

T = TypeVar("T")

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


# --- real time for the serving threads -------------------------------------------------


def _policy(tid: int) -> tuple[int, int]:
    """(policy without SCHED_RESET_ON_FORK, real-time priority) of thread ``tid``."""
    return (
        os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK,
        os.sched_getparam(tid).sched_priority,
    )


def _require_realtime() -> None:
    """Skip (fail in CI) where this process may not use SCHED_FIFO: it needs CAP_SYS_NICE."""
    from kvmesh.common.thread_priority import realtime_supported

    allowed: dict[str, bool] = {}

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            allowed["ok"] = True
        except (OSError, AttributeError):
            allowed["ok"] = False

    if realtime_supported():
        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
    if not allowed.get("ok"):
        reason = "SCHED_FIFO is not allowed here (needs Linux and CAP_SYS_NICE)"
        if os.environ.get("KVMESH_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{reason} (KVMESH_REQUIRE_SERVICES=1 requires it)", pytrace=False)
        pytest.skip(reason)


def _in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread of its own (so no test thread keeps a real-time policy)."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(30)
    assert out, "the thread failed"
    return out[0]


def test_a_realtime_thread_starts_its_own_threads_at_the_default_policy() -> None:
    _require_realtime()

    def serve() -> tuple[tuple[int, int], tuple[int, int]]:
        serve_this_thread_in_realtime(7)
        child: list[tuple[int, int]] = []
        thread = threading.Thread(target=lambda: child.append(_policy(0)))
        thread.start()
        thread.join()
        return _policy(0), child[0]

    own, child = _in_thread(serve)
    assert own == (os.SCHED_FIFO, 7)
    assert child == (os.SCHED_OTHER, 0)
    assert _policy(0) == (os.SCHED_OTHER, 0)  # the test's own thread is left alone


def test_priority_zero_changes_nothing_and_out_of_range_is_refused() -> None:
    assert _in_thread(lambda: (serve_this_thread_in_realtime(0), _policy(0))[1]) == (
        os.SCHED_OTHER,
        0,
    )
    for bad in (-1, 100):
        with pytest.raises(ValueError, match=r"0\.\.99"):
            serve_this_thread_in_realtime(bad)


def test_an_executor_with_the_realtime_initializer_runs_its_threads_in_real_time() -> None:
    _require_realtime()
    with ThreadPoolExecutor(max_workers=2, initializer=realtime_initializer(5)) as pool:
        assert pool.submit(_policy, 0).result(10) == (os.SCHED_FIFO, 5)


def test_the_realtime_initializer_logs_and_never_breaks_its_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Priority 100 cannot be set anywhere: the thread serves at the default policy,
    # and the pool still runs work (an initializer that raised would break it).
    with ThreadPoolExecutor(max_workers=1, initializer=realtime_initializer(100)) as pool:
        assert pool.submit(_policy, 0).result(10) == (os.SCHED_OTHER, 0)
    assert "serves at the default priority" in caplog.text


def test_the_copy_kernels_helpers_run_at_their_callers_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require_realtime()
    from kvmesh.kernels import parallel

    # A pool of this test's own, made by the real-time caller below and dropped after.
    monkeypatch.setattr(parallel, "_pool", None)
    monkeypatch.setattr(parallel, "_pool_workers", 0)
    monkeypatch.setattr(parallel, "_copy_threads", 2)
    met = threading.Barrier(2, timeout=10)
    seen: dict[int, tuple[int, int]] = {}

    def piece() -> None:
        seen[threading.get_native_id()] = _policy(0)
        met.wait()  # two pieces, two threads: the helper must take one

    def copy() -> int:
        serve_this_thread_in_realtime(3)
        parallel.run_parallel([piece, piece], parallel.MIN_PARALLEL_BYTES)
        return threading.get_native_id()

    try:
        caller = _in_thread(copy)
    finally:
        if parallel._pool is not None:
            parallel._pool.shutdown(wait=True)
    assert len(seen) == 2
    assert caller in seen
    assert set(seen.values()) == {(os.SCHED_FIFO, 3)}


def test_helpers_of_a_default_caller_stay_at_the_default_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvmesh.kernels import parallel

    monkeypatch.setattr(parallel, "_pool", None)
    monkeypatch.setattr(parallel, "_pool_workers", 0)
    pool = parallel._helper_pool(1)
    try:
        assert pool.submit(_policy, 0).result(10) == (os.SCHED_OTHER, 0)
    finally:
        pool.shutdown(wait=True)
