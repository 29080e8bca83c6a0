"""KeyDirectory: key → placements, with an L1 reverse index and token bindings.

See docs/coordinator.md, "Key directory".

Behaviour follows LMCache 0.5.6: a placement's identity is ``(instance,
tier, backend)`` when private and ``(tier, backend)`` fleet-wide when
shared; a STORE upserts by identity (a shared placement records its *last*
reporter and that reporter's incarnation), a DELETE removes by identity and
drops an emptied record, an ACCESS refreshes ``last_access`` and counts one
use per entry without ever creating a record, and ``fence_instance`` removes
exactly the L1 placements whose recorded reporter is the fenced instance
(L2 always survives, a shared L1 placement re-reported by someone else
survives). Lookups are exact-key; token lookups are resolved by the caller.

Storage is designed for ten million keys without GC or resize stalls; each
part is a module of this package:

* :mod:`.records` — the record codec. Keys are compact ``bytes``
  (``chunk_hash || u32 space id``, see :mod:`kvmesh.coordinator.core.keyspace`) and a record is
  one immutable ``bytes`` value whose identities and reporter streams are
  interned to small ints. No per-key container object exists, so every big
  dict holds only untracked objects and stays untracked by the cyclic GC: a
  full collection costs the same at ten keys or ten million.
* :mod:`.shards` — 4096 dicts by ``hash(ck)`` (a huge dict stalls for
  seconds when it resizes), copy-on-write for checkpoints, so a capture is
  O(shards), not O(keys).
* :mod:`.l1index` — per instance, 256 small dicts ``ck → None``; the
  clean-up after a fence visits only that instance's keys.
* :mod:`.bindings` — token bindings, a bounded hint (4 bytes per token).
* :mod:`.writes` — how STORE / DELETE / ACCESS and fences change the
  parts: fresh keys of one space and size are stored in bulk (C-level
  passes); fencing settles usage and totals in O(streams) and leaves the
  rewriting of records to a sweep in bounded slices (small fences, ≤
  ``fence_sync_keys`` keys, are drained at once, so ``num_keys`` is exact
  for them; during a large drain ``num_keys`` still counts the keys left in
  ``fence_backlog_keys``).
* :mod:`.listing` (paging), :mod:`.restore` (rebuilding from a capture),
  :mod:`.state` (the parts and running totals under one lock) and
  :mod:`.keydirectory` (the :class:`KeyDirectory` consumer itself).

Usage accounting: while applying a batch or a fence, the directory reports
the byte changes it made to the :class:`CacheUsageManager` (see
:mod:`kvmesh.coordinator.core.usage`), so directory and usage can never disagree. In particular a
shared L1 placement fenced here is un-counted there too (LMCache's usage
view never fenced shared L1; docs/coordinator.md, "Usage").
"""

from .bindings import DEFAULT_TOKEN_BINDING_CAP
from .keydirectory import DEFAULT_FENCE_SYNC_KEYS, DEFAULT_RECLAIM_PER_BATCH, KeyDirectory
from .listing import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT
from .records import PlacementIdentity
from .shards import NUM_SHARDS

__all__ = [
    "DEFAULT_FENCE_SYNC_KEYS",
    "DEFAULT_LIST_LIMIT",
    "DEFAULT_RECLAIM_PER_BATCH",
    "DEFAULT_TOKEN_BINDING_CAP",
    "MAX_LIST_LIMIT",
    "NUM_SHARDS",
    "KeyDirectory",
    "PlacementIdentity",
]
