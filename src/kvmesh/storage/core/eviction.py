"""Eviction for L1 and L2: byte watermarks, LRU, per-cache_salt quotas, pins.

What differs from LMCache 0.5.6's L1 eviction, and why:

- Watermarks are in **bytes** of the *configured* capacity. LMCache counts
  objects (a 4 KiB partial chunk weighs as much as a 32 MiB one) and
  measures usage against the lazily grown heap, so it evicts while most of
  the configured pool is still unmapped.
- Per-salt quotas work on L1 (LMCache's IsolatedLRU crashes its L1 eviction
  thread, issue #4817). A salt over its quota loses its own least recently
  used keys first, never another salt's. Salts without a quota are exempt
  unless a default quota is set explicitly (LMCache treats an unregistered
  salt as limit 0, i.e. evict everything).
- The loops catch and log every error, so eviction can never die silently.
- Eviction also runs synchronously when an allocation fails (evict, then the
  caller retries once), so a store is not refused while evictable memory
  exists.
- Read-locked and staging L1 objects are never evicted; L2 keys pinned by a
  prefetch that is loading them are never deleted from L2.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey, validate_cache_salt
from kvmesh.storage.core.controllers.l2tier import L2Tier
from kvmesh.storage.core.l1.manager import L1Manager
from kvmesh.storage.core.l1.pool import L1Pool
from kvmesh.storage.core.l1.results import RemovalReason
from kvmesh.storage.core.l2.base import L2Unavailable
from kvmesh.storage.core.lru import DEFAULT_BATCH_KEYS, ByteLRU
from kvmesh.storage.core.pins import PinTable

logger = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 1.0
DEFAULT_TRIGGER_WATERMARK = 0.8
DEFAULT_TARGET_WATERMARK = 0.7


# -- quotas ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Quota:
    """Byte limits of one cache_salt. None = no limit on that tier.

    The L2 limit applies to each L2 adapter separately (bytes of the salt
    held by that adapter).
    """

    l1_bytes: int | None = None
    l2_bytes: int | None = None


class QuotaManager:
    """Per-cache_salt quotas shared by L1 and L2 eviction.

    A salt without a quota gets ``default``; ``default=None`` (the default)
    means such salts are exempt. Thread-safe; observers are told of every
    change so eviction can react before its next period.
    """

    def __init__(self, default: Quota | None = None) -> None:
        if default is not None:
            _check_quota(default)
        self._lock = threading.Lock()
        self._quotas: dict[str, Quota] = {}
        self._default = default
        self._observers: list[Callable[[], None]] = []

    @property
    def default(self) -> Quota | None:
        """Quota of salts that have none (None = exempt)."""
        return self._default

    def add_observer(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` after every change."""
        self._observers.append(observer)

    def set_quota(self, salt: str, quota: Quota) -> None:
        """Create or replace a salt's quota."""
        validate_cache_salt(salt)
        _check_quota(quota)
        with self._lock:
            self._quotas[salt] = quota
        self._changed()

    def get_quota(self, salt: str) -> Quota | None:
        """The salt's own quota (not the default), or None."""
        with self._lock:
            return self._quotas.get(salt)

    def effective(self, salt: str) -> Quota | None:
        """The quota that applies to a salt: its own, else the default."""
        with self._lock:
            return self._quotas.get(salt, self._default)

    def delete_quota(self, salt: str) -> bool:
        """Remove a salt's quota; False when it had none."""
        with self._lock:
            existed = self._quotas.pop(salt, None) is not None
        if existed:
            self._changed()
        return existed

    def list_quotas(self) -> dict[str, Quota]:
        """Every explicit quota."""
        with self._lock:
            return dict(self._quotas)

    def _changed(self) -> None:
        for observer in self._observers:
            observer()


def _check_quota(quota: Quota) -> None:
    for name, value in (("l1_bytes", quota.l1_bytes), ("l2_bytes", quota.l2_bytes)):
        if value is not None and value < 0:
            raise InvalidArgument(f"quota {name} must be >= 0, got {value}", field=name)


def _salt_excess(lru: ByteLRU, salt: str, limit: int) -> Callable[[], int]:
    """Bytes a salt holds above its limit, re-read at every call."""
    return lambda: lru.salt_bytes(salt) - limit


# -- L1 policy ---------------------------------------------------------------


class L1EvictionPolicy:
    """LRU over resident L1 keys, fed by the L1 manager's listener calls."""

    def __init__(self, on_admit: Callable[[Sequence[ObjectKey]], None] | None = None) -> None:
        self.lru = ByteLRU()
        self._on_admit = on_admit

    def on_admitted(self, keys: Sequence[ObjectKey], sizes: Sequence[int], from_l2: bool) -> None:
        """New resident keys start as most recently used."""
        self.lru.add(keys, sizes)
        if self._on_admit is not None:
            self._on_admit(keys)

    def on_removed(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], reason: RemovalReason
    ) -> None:
        """Forget keys that left L1."""
        self.lru.remove(keys)

    def on_touched(self, keys: Sequence[ObjectKey]) -> None:
        """Used keys move to the most recently used end."""
        self.lru.touch(keys)


# -- the controller ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class L2EvictionConfig:
    """Eviction of one L2 adapter.

    ``capacity_bytes=None`` uses the capacity the adapter declares; with
    neither, only quotas are enforced. Watermarks are fractions of capacity:
    eviction starts at ``trigger_watermark`` and stops at ``target_watermark``.
    """

    enabled: bool = True
    capacity_bytes: int | None = None
    trigger_watermark: float = DEFAULT_TRIGGER_WATERMARK
    target_watermark: float = DEFAULT_TARGET_WATERMARK


class EvictionController:
    """Keeps L1 and each L2 adapter under their byte watermarks and per-salt quotas.

    Two daemon threads (``kvmesh-l1-evict``, ``kvmesh-l2-evict``) run every
    ``period_s`` and whenever woken (an admission crossed a limit, a quota
    changed); L2 has its own thread because adapter calls may block up to
    their timeout. :meth:`reclaim` runs synchronously on an allocation
    failure. ``close()`` stops and joins both threads.
    """

    def __init__(
        self,
        l1: L1Manager,
        pool: L1Pool,
        quotas: QuotaManager,
        pins: PinTable,
        *,
        tiers: Sequence[L2Tier] = (),
        l2_configs: Mapping[str, L2EvictionConfig] | None = None,
        period_s: float = DEFAULT_PERIOD_S,
        trigger_watermark: float = DEFAULT_TRIGGER_WATERMARK,
        target_watermark: float = DEFAULT_TARGET_WATERMARK,
        max_batch_keys: int = DEFAULT_BATCH_KEYS,
    ) -> None:
        if not 0.0 < target_watermark <= trigger_watermark <= 1.0:
            raise InvalidArgument(
                "eviction watermarks must satisfy 0 < target <= trigger <= 1",
                field="trigger_watermark",
            )
        if period_s <= 0:
            raise InvalidArgument("eviction period must be > 0", field="period_s")
        self.l1 = l1
        self.pool = pool
        self.quotas = quotas
        self.pins = pins
        self.tiers = list(tiers)
        self.period_s = period_s
        self.trigger_watermark = trigger_watermark
        self.target_watermark = target_watermark
        self.max_batch_keys = max_batch_keys
        self._l2_configs = dict(l2_configs or {})
        self.policy = L1EvictionPolicy(on_admit=self._after_admit)
        quotas.add_observer(self.wake)
        self._reclaim_lock = threading.Lock()
        self._closing = threading.Event()
        self._wake_l1 = threading.Event()
        self._wake_l2 = threading.Event()
        self._threads: list[threading.Thread] = []
        # Counters.
        self.l1_evicted_keys = 0
        self.l1_evicted_bytes = 0
        self.l1_quota_evicted_keys = 0
        self.l2_evicted_keys = 0
        self.l2_quota_evicted_keys = 0
        self.reclaims = 0
        self.reclaim_failures = 0
        self.loop_errors = 0

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        """Start the L1 and L2 eviction threads."""
        if self._threads:
            return
        for name, wake, body in (
            ("kvmesh-l1-evict", self._wake_l1, self.evict_l1_once),
            ("kvmesh-l2-evict", self._wake_l2, self.evict_l2_once),
        ):
            thread = threading.Thread(
                target=self._loop, args=(name, wake, body), name=name, daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Stop and join the threads. Idempotent."""
        self._closing.set()
        self._wake_l1.set()
        self._wake_l2.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def wake(self) -> None:
        """Run both loops now instead of at the next period."""
        self._wake_l1.set()
        self._wake_l2.set()

    # -- L1 ---------------------------------------------------------------

    def evict_l1_once(self) -> int:
        """One L1 cycle: reap garbage, enforce salt quotas, then the byte watermark.

        Returns the number of keys evicted.
        """
        self.l1.reap()
        evicted = 0
        for salt in list(self.policy.lru.bytes_by_salt()):
            quota = self.quotas.effective(salt)
            if quota is None or quota.l1_bytes is None:
                continue
            limit = quota.l1_bytes
            if self.policy.lru.salt_bytes(salt) <= limit:
                continue
            n = self._evict_l1_while(_salt_excess(self.policy.lru, salt, limit), salt=salt)
            self.l1_quota_evicted_keys += n
            if n:
                logger.info("evicted %d L1 keys of cache_salt %r over its quota", n, salt)
            evicted += n
        capacity = self.pool.capacity_bytes
        if self.pool.used_bytes >= self.trigger_watermark * capacity:
            target = int(self.target_watermark * capacity)
            n = self._evict_l1_while(lambda: self.pool.used_bytes - target, salt=None)
            if n:
                logger.debug("evicted %d L1 keys above the byte watermark", n)
            evicted += n
        return evicted

    def reclaim(self, sizes: Sequence[int]) -> bool:
        """Evict least recently used keys until ``sizes`` fit in the pool; True when they do.

        Called synchronously when an allocation fails (the caller retries once).
        """
        with self._reclaim_lock:
            self.reclaims += 1
            if self.pool.would_fit(sizes):
                return True
            self.l1.reap()
            tried: set[ObjectKey] = set()
            # First the byte shortfall in one batch; then, if the freed bytes are
            # not contiguous enough, one key at a time until a hole fits.
            need = max(1, sum(sizes) - self.pool.free_bytes)
            while not self.pool.would_fit(sizes):
                batch = self.policy.lru.oldest(need, skip=tried, max_keys=self.max_batch_keys)
                if not batch:
                    self.reclaim_failures += 1
                    return False
                keys = [k for k, _ in batch]
                tried.update(keys)
                evicted, freed = self.l1.evict(keys)
                self.l1_evicted_keys += len(evicted)
                self.l1_evicted_bytes += freed
                need = 1
            return True

    def _evict_l1_while(self, excess: Callable[[], int], *, salt: str | None) -> int:
        """Evict LRU keys (of ``salt`` or all) while ``excess()`` bytes remain above target."""
        tried: set[ObjectKey] = set()
        evicted_total = 0
        while (need := excess()) > 0:
            batch = self.policy.lru.oldest(
                need, salt=salt, skip=tried, max_keys=self.max_batch_keys
            )
            if not batch:
                break  # everything left is locked
            keys = [k for k, _ in batch]
            tried.update(keys)
            evicted, freed = self.l1.evict(keys)
            evicted_total += len(evicted)
            self.l1_evicted_keys += len(evicted)
            self.l1_evicted_bytes += freed
        return evicted_total

    def _after_admit(self, keys: Sequence[ObjectKey]) -> None:
        # Called under the L1 lock: only cheap checks here, the work happens on the thread.
        if self.pool.used_bytes >= self.trigger_watermark * self.pool.capacity_bytes:
            self._wake_l1.set()
            return
        for salt in {k.cache_salt for k in keys}:
            quota = self.quotas.effective(salt)
            if (
                quota is not None
                and quota.l1_bytes is not None
                and self.policy.lru.salt_bytes(salt) > quota.l1_bytes
            ):
                self._wake_l1.set()
                return

    # -- L2 ---------------------------------------------------------------

    def l2_config(self, tier: L2Tier) -> L2EvictionConfig | None:
        """The eviction config of an adapter, or None when disabled.

        Shared adapters (several nodes write the same pool, this node sees only
        its part) are left to the coordinator unless configured explicitly.
        """
        config = self._l2_configs.get(tier.name)
        if config is None:
            config = None if tier.shared else L2EvictionConfig()
        if config is None or not config.enabled:
            return None
        return config

    def evict_l2_once(self) -> int:
        """One L2 cycle over every healthy adapter; returns keys deleted."""
        deleted = 0
        for tier in self.tiers:
            config = self.l2_config(tier)
            if config is None or not tier.available():
                continue
            try:
                deleted += self._evict_tier(tier, config)
            except L2Unavailable as exc:
                logger.warning("L2 eviction of %s skipped: %s", tier.name, exc)
        return deleted

    def _evict_tier(self, tier: L2Tier, config: L2EvictionConfig) -> int:
        index = tier.index
        deleted = 0
        for salt in list(index.bytes_by_salt()):
            quota = self.quotas.effective(salt)
            if quota is None or quota.l2_bytes is None:
                continue
            limit = quota.l2_bytes
            if index.salt_bytes(salt) <= limit:
                continue
            n = self._evict_l2_while(tier, _salt_excess(index, salt, limit), salt=salt)
            self.l2_quota_evicted_keys += n
            if n:
                logger.info(
                    "deleted %d keys of cache_salt %r from L2 %s over its quota", n, salt, tier.name
                )
            deleted += n
        capacity = config.capacity_bytes or tier.declared_capacity_bytes
        if capacity > 0 and index.total_bytes >= config.trigger_watermark * capacity:
            target = int(config.target_watermark * capacity)
            n = self._evict_l2_while(tier, lambda: index.total_bytes - target, salt=None)
            if n:
                logger.debug("deleted %d keys from L2 %s above its watermark", n, tier.name)
            deleted += n
        return deleted

    def _evict_l2_while(self, tier: L2Tier, excess: Callable[[], int], *, salt: str | None) -> int:
        tried: set[ObjectKey] = set()
        deleted = 0
        while (need := excess()) > 0:
            batch = tier.index.oldest(need, salt=salt, skip=tried, max_keys=self.max_batch_keys)
            if not batch:
                break  # everything left is pinned by prefetches
            keys = [k for k, _ in batch]
            tried.update(keys)
            claimed = self.pins.claim_for_delete(tier.name, keys)
            if not claimed:
                continue
            try:
                tier.delete_many(claimed)
            finally:
                self.pins.release_delete(tier.name, claimed)
            deleted += len(claimed)
            self.l2_evicted_keys += len(claimed)
        return deleted

    # -- loop and status ---------------------------------------------------

    def _loop(self, name: str, wake: threading.Event, body: Callable[[], int]) -> None:
        while not self._closing.is_set():
            wake.wait(self.period_s)
            wake.clear()
            if self._closing.is_set():
                break
            try:
                body()
            except Exception:
                # Eviction must never die (LMCache's L1 thread did, #4817): log and go on.
                self.loop_errors += 1
                logger.exception("%s cycle failed; retrying next period", name)

    def stats(self) -> dict[str, Any]:
        """Counters and current figures."""
        return {
            "period_s": self.period_s,
            "trigger_watermark": self.trigger_watermark,
            "target_watermark": self.target_watermark,
            "l1_tracked_keys": len(self.policy.lru),
            "l1_evicted_keys": self.l1_evicted_keys,
            "l1_evicted_bytes": self.l1_evicted_bytes,
            "l1_quota_evicted_keys": self.l1_quota_evicted_keys,
            "l2_evicted_keys": self.l2_evicted_keys,
            "l2_quota_evicted_keys": self.l2_quota_evicted_keys,
            "reclaims": self.reclaims,
            "reclaim_failures": self.reclaim_failures,
            "loop_errors": self.loop_errors,
            "l2_pinned_keys": self.pins.pinned_count,
        }
