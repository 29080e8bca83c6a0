"""KeyDirectory: the directory's one entry point, a cache-event consumer with lookups.

It holds a :class:`DirectoryState` (the parts and totals under one lock),
hands admitted batches and fences to :mod:`.writes`, and answers reads
itself. Reads take the lock only to fetch records: records are immutable
bytes and the intern tables are append-only, so decoding happens outside
the lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import CacheEventBatch, EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core.keyspace import KeySpaces
from kvmesh.coordinator.core.persistence import PersistenceType
from kvmesh.coordinator.core.types import DirectoryStats, KeyInfo, KeyPage, TierTotals
from kvmesh.coordinator.core.usage import CacheUsageManager

from . import writes
from .bindings import DEFAULT_TOKEN_BINDING_CAP, bytes_to_tokens
from .listing import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, PageTokens, walk
from .records import HDR
from .restore import rebuild
from .shards import MASK
from .state import DirectoryState

logger = logging.getLogger(__name__)

DEFAULT_FENCE_SYNC_KEYS = 4096
DEFAULT_RECLAIM_PER_BATCH = 256


class KeyDirectory:
    """Where every key lives in the fleet, as a cache-event consumer."""

    name = "key_directory"
    persistence_type = PersistenceType.CHECKPOINT

    def __init__(
        self,
        spaces: KeySpaces,
        usage: CacheUsageManager | None = None,
        *,
        token_binding_cap: int = DEFAULT_TOKEN_BINDING_CAP,
        fence_sync_keys: int = DEFAULT_FENCE_SYNC_KEYS,
        reclaim_per_batch: int = DEFAULT_RECLAIM_PER_BATCH,
    ) -> None:
        self._st = DirectoryState(
            spaces, usage if usage is not None else CacheUsageManager(), token_binding_cap
        )
        self._fence_sync_keys = fence_sync_keys
        self._reclaim_per_batch = reclaim_per_batch
        self._pages = PageTokens()
        self._restored = False

    @property
    def usage(self) -> CacheUsageManager:
        """The usage view this directory feeds."""
        return self._st.usage

    @property
    def spaces(self) -> KeySpaces:
        """The key-space codec shared with the other consumers."""
        return self._st.spaces

    @property
    def bindings_dropped(self) -> int:
        """Token bindings dropped under the cap so far."""
        return self._st.bindings.dropped

    @property
    def _shards(self) -> list[dict[bytes, bytes]]:
        # The live shard dicts, for benchmarks and tests that size them.
        return self._st.store.shards

    # -- consumer ----------------------------------------------------------

    def consume(self, batch: CacheEventBatch) -> None:
        """Apply one admitted batch (STORE, DELETE, ACCESS; CONFIG only registers the reporter)."""
        st = self._st
        et = batch.event_type
        encoded = st.spaces.encode_batch(batch)
        with st.lock:
            if batch.instance_id not in st.index.by_instance:
                st.index.by_instance[batch.instance_id] = {}
            cks = encoded.cks
            if cks:
                if et == EventType.STORE:
                    writes.apply_store(st, batch, encoded)
                elif et == EventType.DELETE:
                    writes.apply_delete(st, batch, cks, encoded.sids)
                elif et == EventType.ACCESS:
                    writes.apply_access(st, batch, cks)
            if st.index.backlog:
                writes.reclaim(st, self._reclaim_per_batch)

    def fence_instance(self, instance_id: str) -> None:
        """Drop the L1 placements ``instance_id`` last reported (its restart or departure).

        Settled at once in O(streams): the streams are retired and marked
        dead, usage and totals are adjusted from the per-stream rollups, and
        the instance's L1 index is detached. Records are rewritten by the
        sweep (at once when at most ``fence_sync_keys`` keys are involved).
        """
        with self._st.lock:
            writes.fence(self._st, instance_id, self._fence_sync_keys)

    def reclaim_fenced(self, budget: int = 4096) -> int:
        """Sweep up to ``budget`` keys of earlier fences; returns the keys still to sweep."""
        st = self._st
        with st.lock:
            if st.index.backlog:
                writes.reclaim(st, budget)
            return st.index.backlog_keys

    # -- reads -------------------------------------------------------------

    def _records_of(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        """The visible record of each key (call with the lock held)."""
        find = self._st.spaces.find_key
        shards = self._st.store.shards
        visible = self._st.records.visible
        out: list[bytes | None] = []
        for key in keys:
            ck = find(key)
            out.append(None if ck is None else visible(shards[hash(ck) & MASK].get(ck)))
        return out

    def lookup(self, keys: Iterable[ObjectKey], *, with_tokens: bool = True) -> list[KeyInfo]:
        """One KeyInfo per key, in request order; unknown keys have no placements."""
        keys = list(keys)
        st = self._st
        with st.lock:
            values = self._records_of(keys)
            by_hash = st.bindings.by_hash
            placements = st.records.placements
        out: list[KeyInfo] = []
        for key, v in zip(keys, values, strict=True):
            if v is None:
                out.append(KeyInfo(key, ()))
                continue
            la, cnt = HDR.unpack_from(v)
            b = by_hash.get(key[0])
            raw = b[0] if b is not None else b""
            toks = bytes_to_tokens(raw) if with_tokens and raw else ()
            out.append(KeyInfo(key, placements(v), cnt, la, len(raw) // 4, toks))
        return out

    def get_token_ids(self, chunk_hashes: Iterable[bytes]) -> list[tuple[int, ...]]:
        """Tokens bound to each chunk hash; empty for unknown or unfilled bindings."""
        with self._st.lock:
            raws = [self._st.bindings.raw(h) for h in chunk_hashes]
        return [bytes_to_tokens(raw) if raw else () for raw in raws]

    def get_token_binding(self, chunk_hash: bytes) -> tuple[tuple[int, ...], int] | None:
        """``(token_ids, token_offset)`` bound to ``chunk_hash``, or None."""
        with self._st.lock:
            b = self._st.bindings.get(chunk_hash)
        if b is None:
            return None
        return bytes_to_tokens(b[0]), b[1]

    def get_access_counts(self, keys: Iterable[ObjectKey]) -> list[int]:
        """Access count per key (0 for unknown keys)."""
        keys = list(keys)
        with self._st.lock:
            values = self._records_of(keys)
        return [HDR.unpack_from(v)[1] if v else 0 for v in values]

    def get_keys_across_object_groups(self, keys: Iterable[ObjectKey]) -> list[list[ObjectKey]]:
        """Per key: itself plus every stored key differing only in object_group_id, by group."""
        st = self._st
        spaces = st.spaces
        out: list[list[ObjectKey]] = []
        with st.lock:
            shards = st.store.shards
            visible = st.records.visible
            for key in keys:
                found: dict[int, ObjectKey] = {key[3]: key}
                for vsid in spaces.group_variants(key[1], key[2], key[4]):
                    model, rank, group, salt = spaces.space(vsid)
                    if group == key[3]:
                        continue
                    ck = spaces.encode_with_space(key[0], vsid)
                    if visible(shards[hash(ck) & MASK].get(ck)):
                        found[group] = ObjectKey(key[0], model, rank, group, salt)
                out.append([found[g] for g in sorted(found)])
        return out

    def key_bytes(self, tier: Tier, key: ObjectKey) -> int:
        """Bytes of every placement of ``key`` on ``tier``."""
        with self._st.lock:
            v = self._records_of((key,))[0]
        return self._st.records.tier_bytes(v, tier) if v else 0

    def ck_tier_bytes(self, ck: bytes, tier: Tier) -> int:
        """Bytes of every placement of compact key ``ck`` on ``tier``."""
        st = self._st
        with st.lock:
            v = st.store.shards[hash(ck) & MASK].get(ck)
        return st.records.tier_bytes(v, tier) if v else 0

    def holds_tier(self, ck: bytes, tier: Tier) -> bool:
        """True when compact key ``ck`` has at least one placement on ``tier``."""
        st = self._st
        with st.lock:
            v = st.store.shards[hash(ck) & MASK].get(ck)
        return st.records.holds(v, tier)

    def lacking_tier(self, cks: Sequence[bytes], tier: Tier) -> list[int]:
        """Positions of the compact keys that have no placement on ``tier``."""
        st = self._st
        with st.lock:
            shards = st.store.shards
            holds = st.records.holds
            return [
                i for i, ck in enumerate(cks) if not holds(shards[hash(ck) & MASK].get(ck), tier)
            ]

    def delete_targets(
        self, ck: bytes, tier: Tier, is_live: Callable[[str], bool]
    ) -> list[tuple[str, str]]:
        """``(instance_id, backend)`` to send a delete of ``ck`` on ``tier`` to, one per placement.

        A private placement goes to its owner; a shared one to its last
        reporter, or else to any instance that has reported into that pool.
        Placements no live instance can reach are left out.
        """
        st = self._st
        with st.lock:
            v = st.store.shards[hash(ck) & MASK].get(ck)
            if not v:
                return []
            return st.records.delete_targets(v, tier, is_live)

    def list_keys(
        self,
        *,
        tier: Tier | None = None,
        instance_id: str = "",
        backend: str = "",
        limit: int = DEFAULT_LIST_LIMIT,
        page_token: str = "",
        max_scan: int | None = None,
    ) -> KeyPage:
        """A page of keys whose placements pass the filters (placements are filtered too).

        Order is by (shard, compact key); see :mod:`.listing` for what the
        token guarantees while keys change. Tokens are valid only in the
        coordinator process that made them. At most ``max_scan`` keys
        (default ``max(4 * limit, 20000)``) are examined per call.
        """
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidArgument(f"limit must be in [1, {MAX_LIST_LIMIT}]", field="limit")
        scan_budget = max_scan if max_scan is not None else max(4 * limit, 20_000)
        position = self._pages.parse(page_token)
        filtered = tier is not None or bool(instance_id) or bool(backend)
        st = self._st
        with st.lock:
            total = None if filtered else st.num_keys
            out, stop = walk(
                st.store,
                st.records,
                st.bindings,
                st.spaces.decode,
                position,
                tier=tier,
                instance_id=instance_id,
                backend=backend,
                limit=limit,
                scan_budget=scan_budget,
            )
        # A token pointing at the very last key of the last shard would give
        # an empty page; that is harmless and keeps the walk simple.
        next_token = self._pages.make(*stop) if stop is not None else ""
        return KeyPage(tuple(out), next_token, total)

    def stats(self) -> DirectoryStats:
        """Totals without walking keys (the per-instance count sums ≤256 shard sizes).

        While a large fence is being swept, ``num_keys`` still includes up to
        ``fence_backlog_keys`` keys whose only placements were fenced.
        """
        st = self._st
        with st.lock:
            count, nbytes = st.count, st.nbytes
            return DirectoryStats(
                num_keys=st.num_keys,
                num_placements=count[Tier.L1] + count[Tier.L2],
                l1=TierTotals(count[Tier.L1], nbytes[Tier.L1]),
                l2=TierTotals(count[Tier.L2], nbytes[Tier.L2]),
                l1_keys_by_instance=st.index.counts(),
                token_bindings=len(st.bindings),
                token_binding_cap=st.bindings.cap,
                fence_backlog_keys=st.index.backlog_keys,
            )

    def __len__(self) -> int:
        return self._st.num_keys

    def is_gc_untracked(self) -> bool:
        """True when no per-key container is visible to the cyclic GC (for tests and benches)."""
        with self._st.lock:
            return self._st.store.is_gc_untracked() and self._st.index.is_gc_untracked()

    # -- durable component -------------------------------------------------

    def capture(self) -> dict[str, object]:
        """Plain-data state; shard dicts are shared copy-on-write (O(shards), not O(keys)).

        ``{"format": 1, "spaces": [[model, rank, group, salt]…],
        "identities": [[tier, backend, shared, owner]…], "streams": [[instance,
        incarnation]…], "dead_streams": [stream…], "shared_reporters":
        [[identity, [instance…]]…], "shards": [{ck: record}…], "bindings":
        [[chunk_hash, offset, tokens_le_u32]…]}``. Records may still hold
        fenced placements (of ``dead_streams``); restore drops them. The
        reverse index, totals, per-stream rollups and usage are recomputed.
        """
        st = self._st
        with st.lock:
            return {
                "format": 1,
                "spaces": st.spaces.table(),
                **st.records.capture(),
                "shards": st.store.freeze(),
                "bindings": st.bindings.capture(),
            }

    def release_capture(self) -> None:
        """The caller dropped a capture; once none is held, shards stop being copy-on-write.

        Without this a capture stays valid forever and every shard is copied
        on its next write (correct, just wasted work).
        """
        with self._st.lock:
            self._st.store.release()

    def restore(self, state: object) -> None:
        """Load a capture into an empty directory (and an empty usage view).

        Everything is rebuilt aside and swapped in at the end, so a bad
        section leaves the directory untouched.
        """
        st = self._st
        new = rebuild(state, st.spaces)
        with st.lock:
            if st.num_keys or not st.index.is_empty() or self._restored:
                raise ValueError(
                    "key_directory restore requires an empty directory (or it was restored already)"
                )
            if not st.usage.is_empty():
                raise ValueError("key_directory restore requires an empty usage view")
            st.store.replace(new.shards)
            st.records = new.tables
            st.index.by_instance = {**st.index.by_instance, **new.index}
            st.bindings.restore(new.bindings, new.refs)
            st.num_keys = new.num_keys
            st.count = new.count
            st.nbytes = new.nbytes
            self._restored = True
            st.emit_usage(new.deltas)
        logger.info("Key directory restored: %d keys", new.num_keys)
