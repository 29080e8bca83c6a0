"""Paging through the directory: a stable walk in (shard, compact key) order.

The page token is the position after the last key returned, so the walk is
stable while keys change: a key present for the whole walk is returned
exactly once, a key deleted meanwhile is skipped, a key added meanwhile may
or may not appear. A token carries the epoch of the process that made it
and is refused by any other (shard numbers depend on the process's string
hashing).
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
from collections.abc import Callable

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core.keyspace import SPACE_BYTES
from kvmesh.coordinator.core.types import KeyInfo

from .bindings import TokenBindings
from .records import HDR, RecordTables
from .shards import NUM_SHARDS, ShardStore

DEFAULT_LIST_LIMIT = 1000
MAX_LIST_LIMIT = 10_000
_PAGE_TOKEN_VERSION = 1
_PAGE_HEAD = struct.Struct("<B4sH")


class PageTokens:
    """Makes and checks page tokens of this process (a random epoch tells processes apart)."""

    def __init__(self) -> None:
        self._epoch = os.urandom(4)

    def make(self, shard: int, ck: bytes) -> str:
        """The token of the position just after ``ck`` in ``shard``."""
        raw = _PAGE_HEAD.pack(_PAGE_TOKEN_VERSION, self._epoch, shard) + ck
        return base64.urlsafe_b64encode(raw).decode("ascii")

    def parse(self, token: str) -> tuple[int, bytes | None]:
        """``(shard, last key returned)`` of a token; ``(0, None)`` for the empty one."""
        if not token:
            return 0, None
        try:
            raw = base64.urlsafe_b64decode(token.encode("ascii"))
            version, epoch, shard = _PAGE_HEAD.unpack_from(raw)
        except (binascii.Error, UnicodeEncodeError, struct.error, ValueError):
            raise InvalidArgument("malformed page token", field="page_token") from None
        if version != _PAGE_TOKEN_VERSION or shard >= NUM_SHARDS:
            raise InvalidArgument("malformed page token", field="page_token")
        if epoch != self._epoch:
            raise InvalidArgument(
                "page token was issued by another coordinator process; restart the listing",
                field="page_token",
                reason="PAGE_TOKEN_EXPIRED",
            )
        return shard, raw[_PAGE_HEAD.size :]


def walk(
    store: ShardStore,
    records: RecordTables,
    bindings: TokenBindings,
    decode: Callable[[bytes], ObjectKey],
    position: tuple[int, bytes | None],
    *,
    tier: Tier | None,
    instance_id: str,
    backend: str,
    limit: int,
    scan_budget: int,
) -> tuple[list[KeyInfo], tuple[int, bytes] | None]:
    """Keys from ``position`` whose placements pass the filters; and where to go on (None: done).

    Call with the directory's lock held. Stops after ``limit`` keys found
    or ``scan_budget`` keys examined.
    """
    shard, after = position
    filtered = tier is not None or bool(instance_id) or bool(backend)
    out: list[KeyInfo] = []
    scanned = 0
    by_hash = bindings.by_hash
    while shard < NUM_SHARDS:
        keys = store.sorted_keys(shard)
        start = 0
        if after is not None:
            lo, hi = 0, len(keys)
            while lo < hi:  # first key > after
                mid = (lo + hi) // 2
                if keys[mid] <= after:
                    lo = mid + 1
                else:
                    hi = mid
            start = lo
        data = store.shards[shard]
        for ck in keys[start:]:
            scanned += 1
            v = data[ck]
            pls = records.placements(v)
            if filtered:
                pls = tuple(
                    p
                    for p in pls
                    if (tier is None or p.tier == tier)
                    and (not instance_id or p.instance_id == instance_id)
                    and (not backend or p.backend == backend)
                )
            if pls:
                la, cnt = HDR.unpack_from(v)
                b = by_hash.get(ck[:-SPACE_BYTES])
                ntok = len(b[0]) // 4 if b is not None else 0
                out.append(KeyInfo(decode(ck), pls, cnt, la, ntok))
            if len(out) >= limit or scanned >= scan_budget:
                return out, (shard, ck)
        shard += 1
        after = None
    return out, None
