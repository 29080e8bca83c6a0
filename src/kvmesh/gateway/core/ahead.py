"""Loads started ahead: a retrieve the scheduler starts, which the worker's Retrieve joins.

The engine's scheduler knows a load's blocks when it allocates them, a few
milliseconds before its worker runs the step and asks for the load. For an
engine whose KV memory is host memory, the scheduler sends ``RetrieveAhead``
then, and the copy runs during that hand-off; the worker's ``Retrieve`` for
the same load waits for the copy instead of starting one (docs/vllm.md,
"Loads started by the scheduler").

One rule keeps that safe: once a worker has asked for a load, no ahead call
for it starts a copy, so the engine's blocks are never written after its
worker was told the load was done. Every Retrieve, once checked, leaves a
tombstone of its load's key, kept for ``keep_s`` (far past the ahead call's
deadline), and an ahead call for a tombstoned key starts nothing.

A load is identified by a digest of everything that decides what it writes:
engine, request, model, world size, salt, range, skip, block ids, and the
range's first and last chained chunk hashes (which stand for its tokens).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from .types import PromptRangeSpec

logger = logging.getLogger(__name__)

#: How long a worker's load is remembered, so a late ahead call for it starts nothing.
KEEP_S = 120.0
#: Ahead loads not yet joined, at most; the oldest is forgotten past this (its copy goes on).
MAX_PENDING = 1024


def load_key(
    engine_id: str,
    rng: PromptRangeSpec,
    block_ids: Sequence[int],
    skip_first_n_tokens: int,
    chunk_hashes: Sequence[bytes],
) -> bytes:
    """The digest that names one whole load of a request into an engine's blocks.

    ``chunk_hashes`` are the range's chained chunk hashes (the last one stands for
    every token up to it), so the tokens themselves need no hashing here.
    """
    h = hashlib.blake2b(digest_size=16)
    for part in (engine_id, rng.request_id, rng.model_name, rng.cache_salt):
        encoded = part.encode()
        h.update(len(encoded).to_bytes(4, "little"))
        h.update(encoded)
    numbers = (rng.world_size, rng.start_token, rng.end_token, skip_first_n_tokens)
    h.update(np.asarray(numbers, dtype=np.int64).tobytes())
    blocks = np.asarray(block_ids, dtype=np.int64)
    h.update(len(blocks).to_bytes(8, "little"))
    h.update(blocks.tobytes())
    h.update(len(chunk_hashes).to_bytes(8, "little"))
    if chunk_hashes:
        h.update(chunk_hashes[0])
        h.update(chunk_hashes[-1])
    return h.digest()


class AheadLoads:
    """The ahead loads not yet joined, and the loads workers already asked for."""

    def __init__(
        self,
        *,
        keep_s: float = KEEP_S,
        max_pending: int = MAX_PENDING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep_s = keep_s
        self.max_pending = max_pending
        self._clock = clock
        #: key -> (request id, the copy's task), oldest first.
        self._pending: OrderedDict[bytes, tuple[str, asyncio.Future[int]]] = OrderedDict()
        #: key -> when a worker asked for it, oldest first.
        self._asked: OrderedDict[bytes, float] = OrderedDict()

    def _expire(self) -> None:
        horizon = self._clock() - self.keep_s
        while self._asked:
            key, at = next(iter(self._asked.items()))
            if at > horizon:
                break
            del self._asked[key]

    def may_start(self, key: bytes) -> bool:
        """False when a worker already asked for this load or an ahead copy of it is running."""
        self._expire()
        return key not in self._asked and key not in self._pending

    def start(self, key: bytes, request_id: str, task: asyncio.Future[int]) -> None:
        """Record a started copy (call right after :meth:`may_start`, with no await between)."""
        task.add_done_callback(_log_unjoined_failure)
        self._pending[key] = (request_id, task)
        while len(self._pending) > self.max_pending:
            _, (old_request, _) = self._pending.popitem(last=False)
            logger.warning("ahead load of %s was never joined; forgetting it", old_request)

    def claim(self, key: bytes) -> asyncio.Future[int] | None:
        """A worker asks for the load: tombstone the key; the ahead copy to wait for, if any."""
        self._expire()
        self._asked[key] = self._clock()
        self._asked.move_to_end(key)
        entry = self._pending.pop(key, None)
        return None if entry is None else entry[1]

    def forget_request(self, request_id: str) -> int:
        """Drop a request's unjoined ahead loads (its session ended); how many."""
        keys = [key for key, (rid, _) in self._pending.items() if rid == request_id]
        for key in keys:
            del self._pending[key]
        return len(keys)

    def __len__(self) -> int:
        return len(self._pending)


def _log_unjoined_failure(task: asyncio.Future[int]) -> None:
    """Read a failed copy's error so asyncio does not report it as never retrieved;
    a worker that joins it gets the same error."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.debug("ahead load failed: %s", exc)
