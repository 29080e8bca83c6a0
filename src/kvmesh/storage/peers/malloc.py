"""Keep megabyte-sized buffers in the heap: the P2P stream allocates one per frame.

With glibc's defaults every buffer of a few MiB (a frame's bytes, gRPC's
message buffers) is a fresh ``mmap``: the kernel zero-fills its pages on first
touch and unmaps them again on free, and that page-fault work measured about
half the CPU of a P2P stream on the benchmark host (``perf``:
``clear_page_erms``, ``exc_page_fault``). Raising the mmap threshold to its
maximum (32 MiB on 64-bit) and the trim threshold to 128 MiB lets freed frames
be reused, warm, from the heap; the stream ran about twice as fast. glibc
only: elsewhere (or if ``mallopt`` refuses) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 128 * 1024 * 1024


def keep_large_allocations() -> bool:
    """Tune the allocator of this process (idempotent); True when glibc accepted it."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        logger.debug("mallopt refused the P2P allocator settings; keeping the defaults")
    return ok
