"""Fleet L2 eviction: per-salt quotas, LRU order, pins, deletes to the holders (reference §4.4).

What stays as in LMCache 0.5.6:

* the controller consumes **L2** batches only: STORE inserts or refreshes a
  key at the most-recent end of its salt's LRU, ACCESS refreshes a tracked
  key (an unknown key is ignored), DELETE drops the key once no L2 copy of
  it remains (the directory — and therefore the usage view — has already
  applied the batch, because the directory is registered first);
* a plan is pure: for each tracked salt with usage > 0 and an effective
  limit, if usage ≥ ``trigger_watermark × limit`` take
  ``int(pool × ratio)`` (at least 1 when ratio > 0) of the oldest unpinned
  keys, ratio 1.0 when the limit is 0;
* the default quota is explicit: None (the boot state) exempts salts
  without a quota, 0 arms allowlist eviction, > 0 is a per-salt budget;
* pins are reference counts on the chunk key (``object_group_id`` forced to
  0, so one pin covers every group), operator intent saved as metadata;
* the LRU and usage change only when the resulting DELETE events come back,
  so a failed or unsent delete simply reappears in the next plan.

kvmesh changes (fixes of reference §12.8 and hardening):

* deletes go through a :class:`DeleteDispatcher` (the node's own command
  stream), not HTTP to a random node: each victim is sent, per L2
  placement, to an instance that really holds it — the owner of a private
  copy, the last live reporter (or any live reporter) of a shared pool —
  naming the placement's backend, so copies on non-primary adapters are
  deleted too; requests carry at most ``max_delete_batch`` (10 000) keys;
* victims held by no live instance are skipped without counting, so they
  cannot block the keys behind them; victims sent less than
  ``redispatch_after`` seconds ago count toward the target but are not sent
  again;
* a readiness gate: nothing is planned for deletion until ``ready_delay``
  (one heartbeat period) has passed since start or restore, or
  :meth:`FleetEvictionController.mark_ready` is called, so a cold or
  restored coordinator whose view is still filling never mass-evicts;
* each cycle selects at most ``max_victims_per_cycle`` keys per salt.

LRU storage: per salt, up to 4096 small dicts ``ck → stamp`` (sharded like
the directory, untracked by the GC, copy-on-write for checkpoints and for
the planner's snapshot). A stamp is one shared int per batch, so the exact
global order is a k-way merge of the shards; keys of one batch tie.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Protocol, cast, runtime_checkable

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import CacheEventBatch, EventType, Tier
from kvmesh.common.keys import ObjectKey, validate_cache_salt

from .directory import KeyDirectory
from .keyspace import SHARD_BITS, EncodedBatch, KeySpaces, space_id_of
from .persistence import PersistenceType
from .types import DeleteRequest, EvictionReport, PinEntry, PinPage
from .usage import CacheUsageManager

logger = logging.getLogger(__name__)

MAX_DELETE_BATCH = 10_000
DEFAULT_EVICTION_RATIO = 0.2
DEFAULT_TRIGGER_WATERMARK = 1.0
DEFAULT_MAX_VICTIMS_PER_CYCLE = 100_000
# The directory's sharding, so a batch's shard numbers are computed once for both.
_LRU_SHARD_BITS = SHARD_BITS
_LRU_MASK = (1 << _LRU_SHARD_BITS) - 1
# Runs a map() to the end in C (a maxlen-0 deque keeps nothing).
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


@runtime_checkable
class DeleteDispatcher(Protocol):
    """Sends a delete command to one storage node (over its command stream).

    Returns True when the command was accepted for delivery (the node's
    stream is open), False otherwise. It must not block for long and must
    not call back into the coordinator. The node deletes the keys from
    ``backend`` on ``tier`` and reports DELETE events, which is what
    updates the directory, usage and LRU.
    """

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> bool:
        """Ask ``instance_id`` to delete ``keys`` from ``backend`` ("" = every adapter) on ``tier``.

        ``force`` also deletes objects the node holds locks on (operator deletes only).
        """


# -- quotas ------------------------------------------------------------------


class QuotaManager:
    """Per-salt L2 byte limits plus an explicit default (None = unquota'd salts exempt)."""

    name = "quotas"
    persistence_type = PersistenceType.METADATA

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._limits: dict[str, int] = {}
        self._default: int | None = None

    def set_quota(self, cache_salt: str, limit_bytes: int) -> None:
        """Set ``cache_salt``'s limit; 0 is allowed (evict everything, still listed)."""
        validate_cache_salt(cache_salt)
        if limit_bytes < 0:
            raise InvalidArgument("quota limit must be >= 0 bytes", field="limit_bytes")
        with self._lock:
            self._limits[cache_salt] = int(limit_bytes)

    def delete_quota(self, cache_salt: str) -> bool:
        """Remove ``cache_salt``'s limit; False when it had none."""
        with self._lock:
            return self._limits.pop(cache_salt, None) is not None

    def get_limit_bytes(self, cache_salt: str) -> int:
        """Explicit limit of ``cache_salt`` (0 when it has none)."""
        with self._lock:
            return self._limits.get(cache_salt, 0)

    def has_quota(self, cache_salt: str) -> bool:
        """True when ``cache_salt`` has an explicit limit."""
        with self._lock:
            return cache_salt in self._limits

    def effective_limit_bytes(self, cache_salt: str) -> int | None:
        """The explicit limit, else the default; None means exempt."""
        with self._lock:
            return self._limits.get(cache_salt, self._default)

    def list_quotas(self) -> dict[str, int]:
        """Every explicit limit."""
        with self._lock:
            return dict(self._limits)

    def set_default_limit_bytes(self, limit_bytes: int | None) -> None:
        """Set the default for salts without a quota (None = exempt)."""
        if limit_bytes is not None and limit_bytes < 0:
            raise InvalidArgument("default quota must be >= 0 bytes or unset", field="limit_bytes")
        with self._lock:
            self._default = None if limit_bytes is None else int(limit_bytes)

    def get_default_limit_bytes(self) -> int | None:
        """The default limit (None = unquota'd salts are exempt)."""
        with self._lock:
            return self._default

    def capture(self) -> dict[str, object]:
        """``{"limits": {salt: bytes}, "default_limit_bytes": int | None}``."""
        with self._lock:
            return {"limits": dict(self._limits), "default_limit_bytes": self._default}

    def restore(self, state: object) -> None:
        """Replace the quotas with a capture."""
        if not isinstance(state, Mapping):
            raise TypeError("quotas state must be a mapping")
        limits = state.get("limits", {})
        default = state.get("default_limit_bytes")
        if not isinstance(limits, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in limits.items()
        ):
            raise ValueError("quotas state has malformed limits")
        if default is not None and (not isinstance(default, int) or default < 0):
            raise ValueError("quotas state has a malformed default")
        with self._lock:
            self._limits = dict(limits)
            self._default = default


# -- pins ----------------------------------------------------------------------

_PinKey = tuple[bytes, str, int, str]
"""(chunk_hash, model_name, kv_rank, cache_salt): the key with object_group_id 0."""


def _pin_key(key: ObjectKey) -> _PinKey:
    return (key[0], key[1], key[2], key[4])


class PinTable:
    """Reference-counted L2 pins on chunk keys, in first-pinned order."""

    name = "pins"
    persistence_type = PersistenceType.METADATA

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[_PinKey, int] = {}

    def pin(self, keys: Iterable[ObjectKey]) -> int:
        """Add one pin to each key; returns how many keys were given."""
        n = 0
        with self._lock:
            for key in keys:
                pk = _pin_key(key)
                self._counts[pk] = self._counts.get(pk, 0) + 1
                n += 1
        return n

    def unpin(self, keys: Iterable[ObjectKey]) -> int:
        """Remove one pin from each key (never below zero); returns how many keys were given."""
        n = 0
        with self._lock:
            for key in keys:
                n += 1
                pk = _pin_key(key)
                c = self._counts.get(pk)
                if c is None:
                    continue
                if c <= 1:
                    del self._counts[pk]
                else:
                    self._counts[pk] = c - 1
        return n

    def drop_pins(self, keys: Iterable[ObjectKey]) -> int:
        """Remove every pin of each key whatever its count; returns how many were pinned."""
        with self._lock:
            return sum(self._counts.pop(_pin_key(k), None) is not None for k in keys)

    def is_pinned(self, key: ObjectKey) -> bool:
        """True when ``key`` (any object group) is pinned."""
        return _pin_key(key) in self._counts

    def is_pinned_parts(self, chunk_hash: bytes, model: str, kv_rank: int, salt: str) -> bool:
        """Same as :meth:`is_pinned` from the key's parts."""
        return (chunk_hash, model, kv_rank, salt) in self._counts

    def pin_count(self, key: ObjectKey) -> int:
        """Pins on ``key`` (0 when none)."""
        return self._counts.get(_pin_key(key), 0)

    def filter_unpinned(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """The unpinned keys, in order."""
        return [k for k in keys if _pin_key(k) not in self._counts]

    def __len__(self) -> int:
        return len(self._counts)

    def list_pins(
        self,
        cache_salt: str | None = None,
        model_name: str | None = None,
        limit: int = 1000,
        page_token: str = "",
    ) -> PinPage:
        """A page of pins in first-pinned order, optionally filtered by salt and model.

        The page token is the position in the filtered list (pins are operator
        intent and change rarely; concurrent pin changes may shift a page).
        """
        if not 1 <= limit <= 10_000:
            raise InvalidArgument("limit must be in [1, 10000]", field="page_size")
        try:
            offset = int(page_token) if page_token else 0
        except ValueError:
            offset = -1
        if offset < 0:
            raise InvalidArgument("malformed page token", field="page_token")
        with self._lock:
            rows = [
                (pk, c)
                for pk, c in self._counts.items()
                if (cache_salt is None or pk[3] == cache_salt)
                and (model_name is None or pk[1] == model_name)
            ]
        page = tuple(
            PinEntry(ObjectKey(pk[0], pk[1], pk[2], 0, pk[3]), c)
            for pk, c in rows[offset : offset + limit]
        )
        nxt = str(offset + limit) if offset + limit < len(rows) else ""
        return PinPage(total=len(rows), pins=page, next_page_token=nxt)

    def capture(self) -> dict[str, object]:
        """``{"entries": [{"key": {...}, "count": n}]}``.

        The key is LMCache's EncodedObjectKey shape: ``chunk_hash_hex``,
        ``model_name``, ``kv_rank``, ``object_group_id`` (0), ``cache_salt``.
        """
        with self._lock:
            return {
                "entries": [
                    {
                        "key": {
                            "chunk_hash_hex": pk[0].hex(),
                            "model_name": pk[1],
                            "kv_rank": pk[2],
                            "object_group_id": 0,
                            "cache_salt": pk[3],
                        },
                        "count": c,
                    }
                    for pk, c in self._counts.items()
                ]
            }

    def restore(self, state: object) -> None:
        """Replace the pins; counts ≤ 0 are dropped, rows of one chunk key are merged."""
        if not isinstance(state, Mapping):
            raise TypeError("pins state must be a mapping")
        counts: dict[_PinKey, int] = {}
        for row in state.get("entries", []):
            k = row["key"]
            count = int(row["count"])
            if count <= 0:
                continue
            pk = (
                bytes.fromhex(k["chunk_hash_hex"]),
                str(k["model_name"]),
                int(k["kv_rank"]),
                str(k.get("cache_salt", "")),
            )
            counts[pk] = counts.get(pk, 0) + count
        with self._lock:
            self._counts = counts


# -- LRU -----------------------------------------------------------------------


class _SaltBucket:
    __slots__ = ("count", "frozen", "shards")

    def __init__(self) -> None:
        self.shards: dict[int, dict[bytes, int]] = {}
        self.frozen: set[int] = set()
        self.count = 0

    def for_write(self, k: int) -> dict[bytes, int]:
        """Shard ``k`` to write to: created if missing, copied if a snapshot holds it."""
        sh = self.writable(k, True)
        assert sh is not None
        return sh

    def writable(self, k: int, create: bool) -> dict[bytes, int] | None:
        sh = self.shards.get(k)
        if sh is None:
            if not create:
                return None
            sh = self.shards[k] = {}
        elif k in self.frozen:
            sh = self.shards[k] = sh.copy()
            self.frozen.discard(k)
        return sh


class IsolatedLRU:
    """Per-salt LRU order of L2 keys (compact keys), oldest first."""

    name = "lru_order"
    persistence_type = PersistenceType.CHECKPOINT

    def __init__(self, spaces: KeySpaces) -> None:
        self._spaces = spaces
        self._lock = threading.Lock()
        self._salts: dict[str, _SaltBucket] = {}
        self._stamp = 0
        self._holds = 0

    def _bucket(self, sid: int, create: bool) -> tuple[str, _SaltBucket | None]:
        salt = self._spaces.salt(sid)
        bucket = self._salts.get(salt)
        if bucket is None and create:
            bucket = self._salts[salt] = _SaltBucket()
        return salt, bucket

    def on_keys_created(self, cks: Sequence[bytes], sids: Sequence[int]) -> None:
        """Insert keys, or move tracked ones, to the most-recent end (``sids``: their spaces)."""
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
            last_sid = -1
            bucket = _SaltBucket()
            shards = bucket.shards
            frozen = bucket.frozen
            grown = 0
            for ck, sid in zip(cks, sids, strict=True):
                if sid != last_sid:
                    bucket.count += grown
                    grown = 0
                    _salt, b = self._bucket(sid, True)
                    assert b is not None
                    bucket = b
                    shards = bucket.shards
                    frozen = bucket.frozen
                    last_sid = sid
                k = hash(ck) & _LRU_MASK
                sh = shards.get(k)
                if sh is None:
                    sh = shards[k] = {}
                elif frozen and k in frozen:
                    sh = bucket.writable(k, False)
                    assert sh is not None
                if sh.pop(ck, None) is None:
                    grown += 1
                sh[ck] = stamp
            bucket.count += grown

    def on_batch_created(self, encoded: EncodedBatch) -> None:
        """:meth:`on_keys_created` of one batch's keys, in bulk when they share one salt.

        Same effect, key by key: each key is removed if tracked and appended
        at the most-recent end, in entry order; only the per-key Python loop
        becomes C-level passes (which needs the keys to be distinct).
        """
        if encoded.sid < 0 or not encoded.unique:
            self.on_keys_created(encoded.cks, encoded.sids)
            return
        cks = encoded.cks
        sis = encoded.shards
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
            _salt, bucket = self._bucket(encoded.sid, True)
            assert bucket is not None
            found = list(map(bucket.shards.get, sis))
            if bucket.frozen or None in found:
                dicts = [bucket.for_write(k) for k in sis]
            else:
                dicts = cast(list[dict[bytes, int]], found)
            n = len(cks)
            # One probe per key appends the untracked ones: a store of fresh
            # keys (the common case) is done. Stamps only grow, so a key that
            # was tracked returns an older one; then every key of the batch
            # is moved to the end in entry order, the order the key-by-key
            # path leaves.
            stamps = list(map(dict.setdefault, dicts, cks, itertools.repeat(stamp, n)))
            tracked = n - stamps.count(stamp)
            if tracked:
                _consume(map(dict.pop, dicts, cks))
                _consume(map(dict.__setitem__, dicts, cks, itertools.repeat(stamp, n)))
            bucket.count += n - tracked

    def on_keys_touched(self, cks: Sequence[bytes], sids: Sequence[int]) -> None:
        """Move tracked keys to the most-recent end; unknown keys are ignored."""
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
            for ck, sid in zip(cks, sids, strict=True):
                _salt, bucket = self._bucket(sid, False)
                if bucket is None:
                    continue
                k = hash(ck) & _LRU_MASK
                sh = bucket.shards.get(k)
                if sh is None or ck not in sh:
                    continue
                sh = bucket.writable(k, False)
                assert sh is not None
                del sh[ck]
                sh[ck] = stamp

    def on_keys_removed(self, cks: Iterable[bytes], sids: Iterable[int]) -> None:
        """Forget keys; an emptied salt bucket is dropped."""
        with self._lock:
            for ck, sid in zip(cks, sids, strict=True):
                salt, bucket = self._bucket(sid, False)
                if bucket is None:
                    continue
                k = hash(ck) & _LRU_MASK
                sh = bucket.shards.get(k)
                if sh is None or ck not in sh:
                    continue
                sh = bucket.writable(k, False)
                assert sh is not None
                del sh[ck]
                bucket.count -= 1
                if not sh:
                    del bucket.shards[k]
                    bucket.frozen.discard(k)
                if bucket.count == 0:
                    del self._salts[salt]

    def contains(self, ck: bytes, salt: str) -> bool:
        """True when ``ck`` is tracked under ``salt``."""
        with self._lock:
            bucket = self._salts.get(salt)
            if bucket is None:
                return False
            sh = bucket.shards.get(hash(ck) & _LRU_MASK)
            return sh is not None and ck in sh

    def tracked_salts(self) -> list[str]:
        """Salts with at least one tracked key."""
        with self._lock:
            return list(self._salts)

    def count(self, salt: str) -> int:
        """Keys tracked under ``salt``."""
        with self._lock:
            b = self._salts.get(salt)
            return b.count if b is not None else 0

    def snapshot(
        self, salts: Iterable[str] | None = None
    ) -> dict[str, tuple[int, list[dict[bytes, int]]]]:
        """Per salt (all, or ``salts``): key count and shards, frozen copy-on-write (O(shards)).

        Pair every call with :meth:`release_snapshot` once the shards are no
        longer read.
        """
        with self._lock:
            out: dict[str, tuple[int, list[dict[bytes, int]]]] = {}
            chosen = self._salts if salts is None else dict.fromkeys(salts)
            for salt in chosen:
                bucket = self._salts.get(salt)
                if bucket is None:
                    continue
                bucket.frozen = set(bucket.shards)
                out[salt] = (bucket.count, list(bucket.shards.values()))
            self._holds += 1
            return out

    def release_snapshot(self) -> None:
        """A snapshot is no longer read; once none is, shards stop being copy-on-write."""
        with self._lock:
            self._holds = max(0, self._holds - 1)
            if self._holds == 0:
                for bucket in self._salts.values():
                    bucket.frozen.clear()

    release_capture = release_snapshot

    @staticmethod
    def oldest_first(shards: Sequence[Mapping[bytes, int]]) -> Iterator[bytes]:
        """Keys of a snapshot's shards in global LRU order (oldest first)."""
        for ck, _stamp in heapq.merge(*(iter(s.items()) for s in shards), key=itemgetter(1)):
            yield ck

    def order(self, salt: str) -> list[ObjectKey]:
        """Every key of ``salt``, oldest first (for tests and diagnostics)."""
        snap = self.snapshot([salt]).get(salt)
        try:
            if snap is None:
                return []
            return [self._spaces.decode(ck) for ck in self.oldest_first(snap[1])]
        finally:
            self.release_snapshot()

    def capture(self) -> dict[str, object]:
        """``{"spaces": table, "stamp": n, "shards": [[salt, {ck: stamp}]…]}`` (copy-on-write)."""
        snap = self.snapshot()
        with self._lock:
            stamp = self._stamp
        return {
            "spaces": self._spaces.table(),
            "stamp": stamp,
            "shards": [[salt, shard] for salt, (_n, shards) in snap.items() for shard in shards],
        }

    def restore(self, state: object) -> None:
        """Replace the LRU with a capture."""
        if not isinstance(state, Mapping):
            raise TypeError("lru_order state must be a mapping")
        table = state["spaces"]
        mapping = self._spaces.translation(table)
        n_spaces = len(table)
        salts: dict[str, _SaltBucket] = {}
        stamps: dict[int, int] = {}  # share one int object per stamp value
        max_stamp = int(state.get("stamp", 0))
        for salt, shard in state["shards"]:
            if not isinstance(salt, str) or not isinstance(shard, Mapping):
                raise TypeError("lru_order shard row is malformed")
            bucket = salts.get(salt)
            if bucket is None:
                bucket = salts[salt] = _SaltBucket()
            for raw_ck, raw_stamp in shard.items():
                if not isinstance(raw_ck, bytes) or not isinstance(raw_stamp, int):
                    raise TypeError("lru_order entry is malformed")
                ck = self._spaces.retranslate(raw_ck, mapping, n_spaces)
                if self._spaces.salt(space_id_of(ck)) != salt:
                    raise ValueError("lru_order key filed under the wrong salt")
                stamp = stamps.setdefault(raw_stamp, raw_stamp)
                max_stamp = max(max_stamp, stamp)
                sh = bucket.writable(hash(ck) & _LRU_MASK, True)
                assert sh is not None
                if ck not in sh:
                    bucket.count += 1
                sh[ck] = stamp
        # Keys from different captured shards may land in one shard here;
        # keep each shard in stamp order so merges stay exact.
        for bucket in salts.values():
            for k, sh in list(bucket.shards.items()):
                bucket.shards[k] = dict(sorted(sh.items(), key=itemgetter(1)))
        with self._lock:
            self._salts = salts
            self._stamp = max_stamp


# -- controller ----------------------------------------------------------------


class FleetEvictionController:
    """Consumer that keeps the L2 LRU and, on demand, evicts salts over quota."""

    def __init__(
        self,
        spaces: KeySpaces,
        directory: KeyDirectory,
        usage: CacheUsageManager,
        *,
        quotas: QuotaManager | None = None,
        pins: PinTable | None = None,
        lru: IsolatedLRU | None = None,
        is_live: Callable[[str], bool] = lambda _iid: True,
        dispatcher: DeleteDispatcher | None = None,
        eviction_ratio: float = DEFAULT_EVICTION_RATIO,
        trigger_watermark: float = DEFAULT_TRIGGER_WATERMARK,
        max_delete_batch: int = MAX_DELETE_BATCH,
        max_victims_per_cycle: int = DEFAULT_MAX_VICTIMS_PER_CYCLE,
        ready_delay: float = 0.0,
        redispatch_after: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_delete_batch < 1:
            raise ValueError("max_delete_batch must be >= 1")
        self._spaces = spaces
        self._directory = directory
        self._usage = usage
        self.quotas = quotas if quotas is not None else QuotaManager()
        self.pins = pins if pins is not None else PinTable()
        self.lru = lru if lru is not None else IsolatedLRU(spaces)
        self._is_live = is_live
        self.dispatcher = dispatcher
        self._ratio = min(1.0, max(0.0, eviction_ratio))
        self._watermark = trigger_watermark
        self._max_batch = max_delete_batch
        self._max_victims = max_victims_per_cycle
        self._redispatch_after = redispatch_after
        self._clock = clock
        self._ready_delay = ready_delay
        self._ready_at = clock() + ready_delay
        self._inflight: dict[bytes, float] = {}
        self._inflight_lock = threading.Lock()
        self._run_lock = threading.Lock()

    # -- readiness ---------------------------------------------------------

    def arm_readiness(self, delay: float | None = None) -> None:
        """Hold eviction for ``delay`` seconds from now (default: one heartbeat period)."""
        self._ready_at = self._clock() + (self._ready_delay if delay is None else delay)

    def mark_ready(self) -> None:
        """Lift the readiness gate now."""
        self._ready_at = float("-inf")

    def is_ready(self) -> bool:
        """True once eviction may dispatch deletes."""
        return self._clock() >= self._ready_at

    # -- consumer ----------------------------------------------------------

    def consume(self, batch: CacheEventBatch) -> None:
        """Track L2 STORE / ACCESS / DELETE in the LRU; everything else is ignored."""
        if batch.tier != Tier.L2 or not batch.entries:
            return
        et = batch.event_type
        if et not in (EventType.STORE, EventType.ACCESS, EventType.DELETE):
            return
        encoded = self._spaces.encode_batch(batch)
        cks = encoded.cks
        sids = encoded.sids
        if et == EventType.STORE:
            self.lru.on_batch_created(encoded)
        elif et == EventType.ACCESS:
            self.lru.on_keys_touched(cks, sids)
        else:
            # The directory already applied this DELETE: a key leaves the LRU
            # only once no L2 copy of it remains anywhere.
            gone = self._directory.lacking_tier(cks, Tier.L2)
            if gone:
                self.lru.on_keys_removed((cks[i] for i in gone), (sids[i] for i in gone))
                with self._inflight_lock:
                    for i in gone:
                        self._inflight.pop(cks[i], None)

    def fence_instance(self, instance_id: str) -> None:
        """The LRU is L2-only and L2 outlives its reporter: nothing to drop."""

    # -- planning ----------------------------------------------------------

    def _select(self, keep: Callable[[bytes], bool]) -> dict[str, list[bytes]]:
        plan: dict[str, list[bytes]] = {}
        over: dict[str, tuple[int, int]] = {}
        for salt in self.lru.tracked_salts():
            cur = self._usage.get_salt_bytes(Tier.L2, salt)
            if cur <= 0:
                continue
            limit = self.quotas.effective_limit_bytes(salt)
            if limit is None or cur < self._watermark * limit:
                continue
            over[salt] = (cur, limit)
        if not over:
            return plan
        try:
            self._plan_salts(self.lru.snapshot(over), over, keep, plan)
        finally:
            self.lru.release_snapshot()
        return plan

    def _plan_salts(
        self,
        snapshot: Mapping[str, tuple[int, list[dict[bytes, int]]]],
        over: Mapping[str, tuple[int, int]],
        keep: Callable[[bytes], bool],
        plan: dict[str, list[bytes]],
    ) -> None:
        for salt, (count, shards) in snapshot.items():
            cur, limit = over[salt]
            ratio = 1.0 if limit == 0 else self._ratio
            target = int(count * ratio)
            if ratio > 0 and target == 0:
                target = 1
            target = min(target, self._max_victims)
            if target == 0:
                continue
            victims: list[bytes] = []
            for ck in IsolatedLRU.oldest_first(shards):
                if self._pinned(ck) or not keep(ck):
                    continue
                victims.append(ck)
                if len(victims) >= target:
                    break
            if victims:
                plan[salt] = victims
                logger.info(
                    "Eviction plan for salt %r: %d of %d keys (%d bytes, limit %d)",
                    salt,
                    len(victims),
                    count,
                    cur,
                    limit,
                )

    def _pinned(self, ck: bytes) -> bool:
        if not len(self.pins):
            return False
        model, rank, _group, salt = self._spaces.space(space_id_of(ck))
        return self.pins.is_pinned_parts(ck[:-4], model, rank, salt)

    def compute_eviction_plan(self) -> dict[str, list[ObjectKey]]:
        """Victims per salt over its quota, oldest first, pinned keys excluded (no I/O)."""
        plan = self._select(lambda _ck: True)
        return {s: [self._spaces.decode(ck) for ck in cks] for s, cks in plan.items()}

    def _plan_bytes(self, plan: Mapping[str, list[bytes]]) -> dict[str, int]:
        return {
            salt: sum(self._directory.ck_tier_bytes(ck, Tier.L2) for ck in cks)
            for salt, cks in plan.items()
        }

    def execute_evictions(self, *, dry_run: bool = False) -> EvictionReport:
        """Plan, then (unless ``dry_run``) send each victim's deletes to the instances holding it.

        A dry run works even while the readiness gate holds (it sends nothing).
        """
        with self._run_lock:
            if dry_run:
                plan = self._select(lambda _ck: True)
                return EvictionReport(
                    ready=self.is_ready(),
                    plan={
                        s: tuple(self._spaces.decode(ck) for ck in cks) for s, cks in plan.items()
                    },
                    plan_bytes=self._plan_bytes(plan),
                    dry_run=True,
                )
            if not self.is_ready():
                return EvictionReport(ready=False)
            now = self._clock()
            with self._inflight_lock:
                # Forget expired sends (re-sent below if still victims) so the
                # table cannot grow with keys that stopped being victims.
                self._inflight = {
                    ck: t for ck, t in self._inflight.items() if now - t < self._redispatch_after
                }
            targets: dict[bytes, list[tuple[str, str]]] = {}
            undeliverable = 0

            def deliverable(ck: bytes) -> bool:
                nonlocal undeliverable
                t = self._directory.delete_targets(ck, Tier.L2, self._is_live)
                if not t:
                    undeliverable += 1
                    return False
                targets[ck] = t
                return True

            plan = self._select(deliverable)
            groups: dict[tuple[str, str], list[bytes]] = {}
            in_flight = 0
            with self._inflight_lock:
                for cks in plan.values():
                    for ck in cks:
                        sent = self._inflight.get(ck)
                        if sent is not None and now - sent < self._redispatch_after:
                            in_flight += 1
                            continue
                        for inst_backend in targets[ck]:
                            groups.setdefault(inst_backend, []).append(ck)
            requests = self._dispatch(groups, now)
            if undeliverable:
                logger.warning(
                    "Eviction skipped %d victim(s) that no live instance holds", undeliverable
                )
            return EvictionReport(
                ready=True,
                plan={s: tuple(self._spaces.decode(ck) for ck in cks) for s, cks in plan.items()},
                plan_bytes=self._plan_bytes(plan),
                requests=tuple(requests),
                keys_in_flight=in_flight,
                undeliverable=undeliverable,
            )

    def _dispatch(
        self, groups: Mapping[tuple[str, str], list[bytes]], now: float
    ) -> list[DeleteRequest]:
        if not groups:
            return []
        decode = self._spaces.decode
        requests = self.send_deletes(
            {ib: [decode(ck) for ck in cks] for ib, cks in groups.items()}, Tier.L2
        )
        sent = {(r.instance_id, r.backend, k) for r in requests if r.accepted for k in r.keys}
        with self._inflight_lock:
            for (inst, backend), cks in groups.items():
                for ck in cks:
                    if (inst, backend, decode(ck)) in sent:
                        self._inflight[ck] = now
        return requests

    def send_deletes(
        self,
        groups: Mapping[tuple[str, str], Sequence[ObjectKey]],
        tier: Tier,
        *,
        force: bool = False,
    ) -> list[DeleteRequest]:
        """Send ``{(instance, backend): keys}`` in requests of at most ``max_delete_batch`` keys.

        A refused or failed request is logged and reported (not retried here).
        """
        requests: list[DeleteRequest] = []
        if self.dispatcher is None:
            if groups:
                logger.warning("Deletes planned but no delete dispatcher is wired; nothing sent")
            return requests
        for (inst, backend), keys in groups.items():
            for start in range(0, len(keys), self._max_batch):
                chunk = tuple(keys[start : start + self._max_batch])
                try:
                    ok = bool(self.dispatcher.dispatch_delete(inst, tier, backend, chunk, force))
                except Exception:
                    logger.exception("Delete dispatch to %s (%s) failed", inst, backend)
                    ok = False
                if not ok:
                    logger.warning(
                        "Delete of %d key(s) on %s/%s not accepted",
                        len(chunk),
                        inst,
                        backend or "*",
                    )
                requests.append(DeleteRequest(inst, tier, backend, chunk, ok))
        return requests

    def in_flight_count(self) -> int:
        """Victims sent whose DELETE events have not come back yet."""
        with self._inflight_lock:
            return len(self._inflight)
