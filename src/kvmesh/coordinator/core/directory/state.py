"""Everything one directory holds, under one lock: its parts and its running totals."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvmesh.common.events import Tier
from kvmesh.coordinator.core.keyspace import KeySpaces
from kvmesh.coordinator.core.usage import CacheUsageManager, UsageDelta

from .bindings import TokenBindings
from .l1index import L1Index
from .records import RecordTables
from .shards import ShardStore


class DirectoryState:
    """The parts of a :class:`KeyDirectory` and its totals; ``lock`` guards all of it.

    Per-tier counts and bytes are running totals (indexed by ``int(Tier)``:
    ``[unused, L1, L2]``), so statistics never walk keys. While applying a
    batch or a fence the directory reports the byte changes it made to the
    usage view (:meth:`emit_usage`), so directory and usage never disagree.
    """

    __slots__ = (
        "bindings",
        "count",
        "index",
        "lock",
        "nbytes",
        "num_keys",
        "records",
        "spaces",
        "store",
        "usage",
    )

    def __init__(self, spaces: KeySpaces, usage: CacheUsageManager, token_binding_cap: int) -> None:
        self.lock = threading.Lock()
        self.spaces = spaces
        self.usage = usage
        self.store = ShardStore()
        self.records = RecordTables()
        self.index = L1Index()
        self.bindings = TokenBindings(token_binding_cap)
        self.num_keys = 0
        self.count = [0, 0, 0]
        self.nbytes = [0, 0, 0]

    def emit_usage(self, deltas: Mapping[tuple[int, int], int]) -> None:
        """Report byte changes by ``(identity, space)`` to the usage view."""
        if not deltas:
            return
        rows: dict[tuple[Tier, str, str, str], int] = {}
        pids = self.records.pids
        salt = self.spaces.salt
        for (pid, sid), d in deltas.items():
            ident = pids[pid]
            k = (ident.tier, ident.owner, ident.backend, salt(sid))
            rows[k] = rows.get(k, 0) + d
        self.usage.apply_deltas(UsageDelta(*k, d) for k, d in rows.items())
