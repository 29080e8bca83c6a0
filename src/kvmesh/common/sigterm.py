"""SIGTERM as SystemExit, for commands that clean up after themselves (the benchmarks).

``kvmesh bench`` ends on SIGTERM as on Ctrl-C: ``SystemExit(143)`` unwinds it,
and its finally blocks stop the services it started and remove their
directories. A SIGTERM that arrives inside :func:`sigterm_held` waits until the
block ends: a benchmark starts each service under it, so the exit cannot land
between the fork and the moment the benchmark holds the process (raised inside
``Popen`` it would lose the child, and the child's shared memory with it).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class _State:
    held: int = 0
    pending: int | None = None


_STATE = _State()


def _on_sigterm(signum: int, frame: object) -> None:
    if _STATE.held:
        _STATE.pending = signum
        return
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread (call it from there)."""
    signal.signal(signal.SIGTERM, _on_sigterm)


@contextmanager
def sigterm_held() -> Iterator[None]:
    """Hold a SIGTERM off until the block ends, then raise its SystemExit (nests)."""
    _STATE.held += 1
    try:
        yield
    finally:
        _STATE.held -= 1
        if not _STATE.held and _STATE.pending is not None:
            signum, _STATE.pending = _STATE.pending, None
            raise SystemExit(128 + signum)
