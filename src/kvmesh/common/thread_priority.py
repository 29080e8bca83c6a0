"""CPU priority of the calling thread (Linux): lower for background work, real time for serving.

A node's write-through to L2 (checksums, writes into the page cache, fsyncs)
runs beside the requests it serves: on a small host it shares a core with
the event loop answering lookups and the copies of loads an engine waits
for. Linux's ``setpriority`` applied to a thread id changes that thread
alone, so such threads can run at a higher nice value: the scheduler gives
them the CPU others leave, and the serving path first
(docs/architecture.md, "Background work runs at a lower priority").
Raising a nice value needs no privilege; elsewhere this does nothing.

The opposite, for the serving path itself: an operator may run the node's
event loop and its copy threads under ``SCHED_FIFO`` (the ``realtime_priority``
setting; docs/deployment.md, "Real-time priority for the serving threads").
An engine's processes that poll without sleeping then never delay a lookup
or a load the engine is waiting for. Each such thread is set with
``SCHED_RESET_ON_FORK``: the threads it starts (gRPC's, the executors',
the background ones above) begin under the default policy, so only the
threads named here run in real time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: The nice value added to background threads (0..19; 10 gives them about a tenth
#: of a default thread's share of a contended core).
BACKGROUND_NICENESS = 10

#: ``SCHED_FIFO`` priorities Linux accepts (``sched_get_priority_max``).
MAX_REALTIME_PRIORITY = 99


def lower_this_thread(niceness: int = BACKGROUND_NICENESS) -> bool:
    """Add ``niceness`` to the calling thread's nice value; False where that is not possible."""
    if not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + niceness))
    except OSError as exc:
        logger.debug("cannot lower thread %d's priority: %s", tid, exc)
        return False
    return True


def realtime_supported() -> bool:
    """Whether this platform has ``SCHED_FIFO`` with ``SCHED_RESET_ON_FORK`` (Linux)."""
    return all(
        hasattr(os, name) for name in ("sched_setscheduler", "SCHED_FIFO", "SCHED_RESET_ON_FORK")
    )


def serve_this_thread_in_realtime(priority: int) -> None:
    """Run the calling thread under ``SCHED_FIFO`` at ``priority`` (1..99); 0 does nothing.

    Threads it starts afterwards begin under the default policy
    (``SCHED_RESET_ON_FORK``). Raises ``OSError`` where that is not allowed:
    ``PermissionError`` without ``CAP_SYS_NICE`` (root, or
    ``docker run --cap-add SYS_NICE``) or an ``RLIMIT_RTPRIO`` of at least
    ``priority``.
    """
    if priority == 0:
        return
    if not 1 <= priority <= MAX_REALTIME_PRIORITY:
        raise ValueError(f"real-time priority must be 0..{MAX_REALTIME_PRIORITY}, got {priority}")
    if not realtime_supported():
        raise OSError("SCHED_FIFO is not available on this platform (Linux only)")
    os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(priority))


def realtime_initializer(priority: int) -> Callable[[], None]:
    """A ``ThreadPoolExecutor`` initializer running each of its threads at ``priority``.

    A thread that cannot be set is logged and serves at the default priority
    (:func:`_never_raising`). The process's first serving thread is set before
    any pool is made, so a missing privilege is refused at start, not here.
    """
    return _never_raising(lambda: serve_this_thread_in_realtime(priority))


def scheduling_of_this_thread() -> Callable[[], None]:
    """A ``ThreadPoolExecutor`` initializer giving each of its threads the calling thread's
    real-time policy and priority, if it has one (helpers doing that thread's work).

    A thread under the default policy (or another platform) gets a no-op.
    """
    if not realtime_supported():
        return _nothing
    policy = os.sched_getscheduler(0)
    if policy & ~os.SCHED_RESET_ON_FORK not in (os.SCHED_FIFO, os.SCHED_RR):
        return _nothing
    param = os.sched_getparam(0)
    return _never_raising(lambda: os.sched_setscheduler(0, policy, param))


def _never_raising(apply: Callable[[], None]) -> Callable[[], None]:
    """``apply`` as an initializer that logs a failure instead of raising it (an
    initializer that raises breaks the whole pool)."""

    def initialize() -> None:
        try:
            apply()
        except (OSError, ValueError) as exc:
            logger.warning(
                "thread %d serves at the default priority: %s", threading.get_native_id(), exc
            )

    return initialize


def _nothing() -> None:
    """An initializer that leaves the thread as it starts."""
