"""What L1 operations report: per-key outcomes, removal reasons, and the listener protocol.

Its own module so that callers which only read results (controllers,
transactions, copies) and listeners (store controller, eviction policy,
events) depend on this vocabulary rather than on the manager.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

from kvmesh.common.keys import ObjectKey


class L1Result(enum.Enum):
    """Per-key outcome of an L1 operation."""

    SUCCESS = "success"
    KEY_NOT_EXIST = "key_not_exist"
    KEY_NOT_READABLE = "key_not_readable"
    KEY_NOT_WRITABLE = "key_not_writable"
    KEY_IN_WRONG_STATE = "key_in_wrong_state"
    KEY_IS_LOCKED = "key_is_locked"
    OUT_OF_MEMORY = "out_of_memory"


class RemovalReason(enum.Enum):
    """Why a resident object left L1."""

    DELETED = "deleted"  # an explicit delete (operator, coordinator)
    EVICTED = "evicted"  # watermark, quota or allocation-failure eviction
    CLEARED = "cleared"  # clear()
    RELEASED = "released"  # temporary object, last read lock released
    EXPIRED = "expired"  # temporary object whose read locks timed out
    WRITTEN_THROUGH = "written_through"  # skip_l1 store policy after a successful L2 store


class L1Listener(Protocol):
    """Observer of placement changes in L1 (store controller, eviction policy, events)."""

    def on_admitted(self, keys: Sequence[ObjectKey], sizes: Sequence[int], from_l2: bool) -> None:
        """Keys became resident. ``from_l2``: loaded by a prefetch, not written by a client."""
        ...

    def on_removed(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], reason: RemovalReason
    ) -> None:
        """Resident keys left L1."""
        ...

    def on_touched(self, keys: Sequence[ObjectKey]) -> None:
        """Resident keys were used (LRU recency)."""
        ...
