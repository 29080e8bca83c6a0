"""The deadline of the call being served, for work that must not outlive its caller.

A copy into or out of an engine's KV memory must never run after the engine
gave up on the call: the engine then recomputes those blocks or hands them to
another request, and a late copy would write into (or store from) memory
that is no longer the call's. Every kvmesh server sets :data:`CALL_DEADLINE`
for the call it serves (the gRPC interceptor, the local lane), and the node's
copier refuses to *start* a copy whose caller's deadline is less than
:data:`COPY_START_MARGIN_S` away (see ``docs/architecture.md``, "Deadlines").
A copy that has started is memory-bound (milliseconds) and always finishes.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

#: ``time.monotonic()`` by which the caller of the call being served gives up; None: no deadline.
CALL_DEADLINE: ContextVar[float | None] = ContextVar("kvmesh_call_deadline", default=None)

#: A copy does not start with less than this left of its caller's deadline.
COPY_START_MARGIN_S = 0.5


def deadline_in(seconds: float | None) -> float | None:
    """The monotonic deadline ``seconds`` from now (None stays None)."""
    return None if seconds is None else time.monotonic() + seconds


def remaining() -> float | None:
    """Seconds left of the served call's deadline (None: no deadline)."""
    deadline = CALL_DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()
