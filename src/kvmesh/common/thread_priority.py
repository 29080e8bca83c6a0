"""Lower the calling thread's CPU priority (Linux), for work nobody waits on.

A node's write-through to L2 (checksums, writes into the page cache, fsyncs)
runs beside the requests it serves: on a small host it shares a core with
the event loop answering lookups and the copies of loads an engine waits
for. Linux's ``setpriority`` applied to a thread id changes that thread
alone, so such threads can run at a higher nice value: the scheduler gives
them the CPU others leave, and the serving path first
(docs/architecture.md, "Background work runs at a lower priority").
Raising a nice value needs no privilege; elsewhere this does nothing.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

#: The nice value added to background threads (0..19; 10 gives them about a tenth
#: of a default thread's share of a contended core).
BACKGROUND_NICENESS = 10


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
