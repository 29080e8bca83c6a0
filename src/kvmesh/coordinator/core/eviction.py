"""Fleet L2 eviction: per-salt quotas, LRU order, pins, deletes to the holders.

See docs/coordinator.md, "Fleet eviction".

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

kvmesh changes (fixes of LMCache's deletes to one random node, and hardening;
docs/coordinator.md, "Fleet eviction"):

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

The controller's parts live beside it: quotas in :mod:`.quotas`, pins in
:mod:`.pins`, the LRU order in :mod:`.lru`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from kvmesh.common.events import CacheEventBatch, EventType, Tier
from kvmesh.common.keys import ObjectKey

from .directory import KeyDirectory
from .keyspace import KeySpaces, space_id_of
from .lru import IsolatedLRU
from .pins import PinTable
from .quotas import QuotaManager
from .types import DeleteRequest, EvictionReport
from .usage import CacheUsageManager

logger = logging.getLogger(__name__)

MAX_DELETE_BATCH = 10_000
DEFAULT_EVICTION_RATIO = 0.2
DEFAULT_TRIGGER_WATERMARK = 1.0
DEFAULT_MAX_VICTIMS_PER_CYCLE = 100_000


@runtime_checkable
class DeleteDispatcher(Protocol):
    """Sends a delete command to one storage node (over its command stream).

    Returns the command's id when it was accepted for delivery (the node's
    stream is open), "" otherwise (a plain True/False is accepted too, for
    dispatchers that name no commands). It must not block for long and must
    not call back into the coordinator. The node deletes the keys from
    ``backend`` on ``tier`` and reports DELETE events, which is what
    updates the directory, usage and LRU; its answer to the command goes to
    the :class:`~.commands.CommandLedger`.
    """

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> str | bool:
        """Ask ``instance_id`` to delete ``keys`` from ``backend`` ("" = every adapter) on ``tier``.

        ``force`` also deletes objects the node holds locks on (operator deletes only).
        """


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
                    sent = self.dispatcher.dispatch_delete(inst, tier, backend, chunk, force)
                except Exception:
                    logger.exception("Delete dispatch to %s (%s) failed", inst, backend)
                    sent = False
                ok = bool(sent)
                if not ok:
                    logger.warning(
                        "Delete of %d key(s) on %s/%s not accepted",
                        len(chunk),
                        inst,
                        backend or "*",
                    )
                command_id = sent if isinstance(sent, str) else ""
                requests.append(DeleteRequest(inst, tier, backend, chunk, ok, command_id))
        return requests

    def in_flight_count(self) -> int:
        """Victims sent whose DELETE events have not come back yet."""
        with self._inflight_lock:
            return len(self._inflight)
