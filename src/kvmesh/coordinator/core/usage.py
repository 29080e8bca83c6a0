"""Byte usage per tier, per cache salt and per (owner, backend) (docs/coordinator.md, "Usage").

kvmesh change: the usage view keeps **no per-placement table of its own**.
LMCache's CacheUsageManager duplicates every placement's size (another
~150 bytes per key at ten million keys) and fences on its own rules, which
disagree with the directory's for shared L1 (docs/coordinator.md, "Usage": the directory drops a
shared L1 placement whose last reporter is fenced, the usage view never
did). Here the KeyDirectory owns placements and, while it applies a batch or
a fence, reports the byte changes it made as :class:`UsageDelta` rows; this
view only sums them. So the two can never disagree (shared L1 fenced in the
directory is fenced here too), a checkpoint cannot hold a key without its
bytes, and the view is rebuilt from the directory on restore instead of
being captured.

Ordering consequence: the directory applies usage synchronously inside its
own ``consume``; since the directory is registered before the eviction
controller, the controller always reads post-batch usage (LMCache's one
load-bearing ordering rule).

Owner is ``""`` for a shared pool (one pool counted once however many
instances report it) and the instance id for a private placement. A rollup
that drops to zero or below is removed; a negative salt total is logged as
an accounting underflow.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import NamedTuple

from kvmesh.common.events import Tier

logger = logging.getLogger(__name__)


class UsageDelta(NamedTuple):
    """A byte change the directory made to one (tier, owner, backend, salt) bucket."""

    tier: Tier
    owner: str
    backend: str
    cache_salt: str
    delta: int


class CacheUsageManager:
    """Rollups of placement bytes, fed by the KeyDirectory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._salt_bytes: dict[tuple[Tier, str], int] = {}
        self._instance_bytes: dict[tuple[Tier, str, str], int] = {}
        self._total: dict[Tier, int] = {Tier.L1: 0, Tier.L2: 0}

    def apply_deltas(self, deltas: Iterable[UsageDelta]) -> None:
        """Add byte changes (called by the directory under its own lock)."""
        with self._lock:
            salt_bytes = self._salt_bytes
            inst_bytes = self._instance_bytes
            for tier, owner, backend, salt, delta in deltas:
                if not delta:
                    continue
                skey = (tier, salt)
                new = salt_bytes.get(skey, 0) + delta
                if new > 0:
                    salt_bytes[skey] = new
                else:
                    if new < 0:
                        logger.error(
                            "Usage underflow for salt %r on %s: %d bytes; clamped to 0",
                            salt,
                            tier.name,
                            new,
                        )
                    salt_bytes.pop(skey, None)
                ikey = (tier, owner, backend)
                inew = inst_bytes.get(ikey, 0) + delta
                if inew > 0:
                    inst_bytes[ikey] = inew
                else:
                    inst_bytes.pop(ikey, None)
                self._total[tier] = max(0, self._total[tier] + delta)

    def is_empty(self) -> bool:
        """True when no bytes are accounted anywhere."""
        with self._lock:
            return not self._salt_bytes and not self._instance_bytes

    def get_salt_bytes(self, tier: Tier, cache_salt: str) -> int:
        """Bytes of ``cache_salt`` on ``tier``."""
        with self._lock:
            return self._salt_bytes.get((tier, cache_salt), 0)

    def get_bytes_by_salt(self, tier: Tier) -> dict[str, int]:
        """``{salt: bytes}`` of ``tier``; salts with no bytes are absent."""
        with self._lock:
            return {salt: b for (t, salt), b in self._salt_bytes.items() if t is tier}

    def get_bytes_by_instance(self, tier: Tier) -> dict[str, dict[str, int]]:
        """``{owner: {backend: bytes}}`` of ``tier``; shared pools under owner ``""``."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for (t, owner, backend), b in self._instance_bytes.items():
                if t is tier:
                    out.setdefault(owner, {})[backend] = b
        return out

    def get_owner_bytes(self, owner: str) -> dict[tuple[Tier, str], int]:
        """``{(tier, backend): bytes}`` held by ``owner`` (``""`` = shared pools)."""
        with self._lock:
            return {
                (t, backend): b for (t, o, backend), b in self._instance_bytes.items() if o == owner
            }

    def owners(self) -> set[str]:
        """Every owner holding bytes on any tier (``""`` included when a shared pool does)."""
        with self._lock:
            return {o for (_t, o, _b) in self._instance_bytes}

    def get_total_bytes(self, tier: Tier) -> int:
        """Bytes of every placement on ``tier``."""
        with self._lock:
            return self._total[tier]
