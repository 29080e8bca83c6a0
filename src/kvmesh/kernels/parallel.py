"""How one CPU copy is spread over threads: pieces pulled from a shared queue.

A copy (:mod:`kvmesh.kernels.ops`, :mod:`kvmesh.kernels.vllm_cpu`) is cut into
pieces of about :data:`PIECE_BYTES`; the calling thread and up to
:func:`copy_threads` − 1 helpers of one process-wide pool run them. Copies
under :data:`MIN_PARALLEL_BYTES` stay on the calling thread (docs/kernels.md,
"Gather and scatter").
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvmesh.common.thread_priority import scheduling_of_this_thread

#: Below this many bytes a CPU copy stays on the calling thread: handing work to
#: the pool costs tens of microseconds, as much as copying a few hundred KiB.
MIN_PARALLEL_BYTES = 1 << 20
#: Size of the pieces a parallel copy is cut into (see :class:`Batch`).
PIECE_BYTES = 2 << 20

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_copy_threads: int | None = None
_this_thread = threading.local()  # .limit: the cap of copies_limited_to, if any


def set_copy_threads(threads: int | None) -> None:
    """Set how many threads one CPU copy may use; ``None`` follows ``torch.get_num_threads()``.

    One thread reaches about half of a large ``memcpy`` on these machines
    (32 KiB block runs use cached stores, a 32 MiB ``memcpy`` non-temporal
    ones); two threads reach it. Copies smaller than 1 MiB always use one.
    """
    global _copy_threads  # noqa: PLW0603 - process-wide setting, like torch.set_num_threads
    _check_threads(threads)
    _copy_threads = threads


def _check_threads(threads: int | None) -> None:
    if threads is not None and (isinstance(threads, bool) or threads < 1):
        raise ValueError(f"copy threads must be >= 1 or None, got {threads!r}")


@contextlib.contextmanager
def copies_limited_to(threads: int | None) -> Iterator[None]:
    """Copies the calling thread starts inside the block use at most ``threads``
    threads (None: no cap). A node's stores run so (docs/architecture.md,
    "Loads never wait behind stores"); other threads are not affected."""
    _check_threads(threads)
    before = getattr(_this_thread, "limit", None)
    _this_thread.limit = threads
    try:
        yield
    finally:
        _this_thread.limit = before


def copy_threads() -> int:
    """Threads one CPU copy may use (see :func:`set_copy_threads`, :func:`copies_limited_to`)."""
    threads = _copy_threads if _copy_threads is not None else max(1, torch.get_num_threads())
    limit: int | None = getattr(_this_thread, "limit", None)
    return threads if limit is None else min(threads, limit)


def _helper_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_workers  # noqa: PLW0603 - one lazily created pool per process
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            # Helpers do their caller's work, so they run at its priority: a node's
            # copy threads may run in real time (kvmesh.common.thread_priority).
            _pool = ThreadPoolExecutor(
                max_workers=workers,
                thread_name_prefix="kvmesh-copy",
                initializer=scheduling_of_this_thread(),
            )
            _pool_workers = workers
        return _pool


class Batch:
    """Pieces of one copy, pulled from a shared queue by the caller and the helpers.

    Pulling (rather than handing each thread a fixed half) means a thread that
    the OS deschedules, because another process holds its core, delays the copy
    by one piece at most: the others take the rest. The caller waits for the
    pieces, not for the helpers, so a helper that starts late finds nothing to
    do and the copy is already complete.
    """

    def __init__(self, pieces: Sequence[Callable[[], None]]) -> None:
        self._pieces = pieces
        self._next = 0
        self._done = 0
        self._error: BaseException | None = None
        self._cv = threading.Condition()

    def work(self) -> None:
        """Run pieces until none are left."""
        n = len(self._pieces)
        while True:
            with self._cv:
                i = self._next
                self._next += 1
            if i >= n:
                return
            try:
                self._pieces[i]()
            except BaseException as exc:  # re-raised on the caller's thread
                with self._cv:
                    self._error = self._error or exc
            finally:
                with self._cv:
                    self._done += 1
                    if self._done == n:
                        self._cv.notify_all()

    def wait(self) -> None:
        """Block until every piece has run; re-raise the first failure."""
        with self._cv:
            self._cv.wait_for(lambda: self._done == len(self._pieces))
        if self._error is not None:
            raise self._error


def run_parallel(pieces: Sequence[Callable[[], None]], nbytes: int) -> None:
    """Run ``pieces`` (about equal shares of ``nbytes``) on up to :func:`copy_threads` threads."""
    threads = min(copy_threads(), len(pieces)) if nbytes >= MIN_PARALLEL_BYTES else 1
    if threads <= 1:
        for piece in pieces:
            piece()
        return
    batch = Batch(pieces)
    pool = _helper_pool(threads - 1)
    for _ in range(threads - 1):
        pool.submit(batch.work)
    batch.work()
    batch.wait()


def num_pieces(nbytes: int) -> int:
    """How many pieces to cut a copy into: ~2 MiB each, at least one per thread."""
    if nbytes < MIN_PARALLEL_BYTES:
        return 1
    return max(copy_threads(), -(-nbytes // PIECE_BYTES))


def split(count: int, parts: int) -> list[tuple[int, int]]:
    bounds = [count * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def _sequence(tasks: Sequence[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for t in tasks:
            t()

    return run


def group(tasks: Sequence[Callable[[], None]], pieces: int) -> list[Callable[[], None]]:
    """Consecutive ``tasks`` joined into at most ``pieces`` sequential pieces."""
    return [_sequence(tasks[lo:hi]) for lo, hi in split(len(tasks), min(pieces, len(tasks)))]
