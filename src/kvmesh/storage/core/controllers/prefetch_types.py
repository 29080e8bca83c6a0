"""The prefetch controller's public types: its result, its policy, and the peer source port."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.common.keys import ObjectKey


class PrefetchPolicy(enum.Enum):
    """Retention of objects loaded from L2."""

    DEFAULT = "default"  # temporary: freed when the last reader releases it
    RETAIN = "retain"  # kept resident like a client-written object


class PeerSource(Protocol):
    """Fetches a missing prefix from other nodes into L1 (the P2P fetcher)."""

    def submit(
        self,
        request_id: str,
        rows: Sequence[Sequence[ObjectKey]],
        readers: int,
        row_nbytes: Sequence[int] | None,
        done: Callable[[int], None],
    ) -> None:
        """Start fetching; ``done(columns)`` is called once, with the columns now in L1.

        Columns ``[0, columns)`` of ``rows`` are resident and read-locked
        ``readers`` times for the caller. Raises RuntimeError when closed.
        """
        ...

    def alone(self) -> bool:
        """True when, as far as is known without blocking, no other node could help."""
        ...

    def close(self) -> None:
        """Stop: running fetches end early, nothing new starts."""
        ...


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """Outcome of a prefetch, returned exactly once.

    ``hit_chunks`` is the servable prefix in chunks (columns); every key of
    ``locked_keys`` (row-major over the prefix) is read-locked
    ``num_kv_readers`` times for the caller, who releases them with
    ``finish_read``. ``error`` is empty unless the request was aborted.
    """

    request_id: str
    hit_chunks: int
    num_rows: int
    num_chunks: int
    num_kv_readers: int
    l1_hit_cells: int
    l2_hit_cells: int
    locked_keys: tuple[ObjectKey, ...]
    error: str = ""
    #: When its job was submitted, before it took any lock: its earliest locks lapse
    #: one read TTL after (None: not known, as for a result made elsewhere).
    started: float | None = None
