"""The coordinator core as one object: the typed API the gRPC servicers call.

:class:`Coordinator` is :class:`~.components.CoreComponents` (every
component, built and wired in a load-bearing order described there) plus the
:class:`~.runtime.CoreRuntime` and one short typed method per servicer call.
Quotas and pins, the operator's metadata, are methods of its base
:class:`~.operator_metadata.OperatorMetadata`.
The parts with a job of their own live in sibling modules: operator deletes
in :mod:`.deletes`, the token-form lookup in :mod:`.tokens`, the status view
in :mod:`.status`, the memory and quota read models in :mod:`.reports`.

* Resyncs: the gate tells the :class:`~.resync.ResyncPlanner` about every
  fresh cursor and every seq gap, the ingest service about every stream
  that opens (:meth:`Coordinator.stream_opened`); the planner decides
  which node must re-announce its placements (the triggers and why they
  suffice are in :mod:`.resync`) and sends it through the dispatcher.
* Node commands: every transport reports what it sent and what the nodes
  answered to the :class:`~.commands.CommandLedger` (``Coordinator.commands``),
  which counts the answers and keeps the latest refusals for operators.
* Persistence: checkpoint sections are captured under the quiesce lock;
  metadata sections ``pins`` and ``quotas`` are saved on every change, before
  the call returns. At start metadata loads first (so restored keys are
  already pinned), then the checkpoint, then the eviction readiness gate is
  armed for one heartbeat period.
* Timers (daemon threads, sleep first): health sweep, periodic checkpoint,
  eviction cycle, sweep of large fences, resync retries. ``stop()`` stops
  them, then writes a final checkpoint. Loading, saving and the timers are
  run by :class:`~.runtime.CoreRuntime`.

Deletes (fleet eviction and the operator's ``delete_keys``) leave through the
``DeleteDispatcher`` the app wires in with :meth:`Coordinator.set_delete_dispatcher`
(the nodes' command streams; when it also is a ``ResyncDispatcher``, resyncs
leave through it too); their effects arrive later as DELETE events.

Per-entry validation belongs at the servicer edge; :meth:`Coordinator.ingest`
validates (the safe default) and :meth:`Coordinator.ingest_validated` is the
fast path for batches the servicer already checked.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvmesh.common.errors import NotFound
from kvmesh.common.events import CacheEventBatch, IngestResult, Tier, validate_batch
from kvmesh.common.keys import ObjectKey, salt_with_lora

from . import deletes, reports, scoring, tokens
from .blendindex import BlendMatch
from .directory import DEFAULT_LIST_LIMIT
from .eviction import DeleteDispatcher
from .membership import evict_stale
from .operator_metadata import OperatorMetadata
from .persistence import LoadReport
from .runtime import CoreRuntime
from .scheduler import PeriodicTask
from .settings import CoordinatorSettings
from .status import CoordinatorStatus, coordinator_status
from .types import (
    CheckpointResult,
    ConsumerStats,
    CursorInfo,
    DeleteKeysResult,
    DirectoryStats,
    Endpoints,
    EvictionReport,
    FleetMemoryStatus,
    IngestSummary,
    InstanceInfo,
    InstanceMemoryStatus,
    KeyInfo,
    KeyPage,
    QuotaListing,
    QuotaStatus,
    Registration,
    TokenLookup,
)

__all__ = ["Coordinator", "CoordinatorStatus"]

logger = logging.getLogger(__name__)

_SWEEP_SLICE = 1024


class Coordinator(OperatorMetadata):
    """Every coordinator component, wired, with the servicers' typed entry points."""

    def __init__(
        self,
        settings: CoordinatorSettings | None = None,
        *,
        dispatcher: DeleteDispatcher | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(settings, dispatcher=dispatcher, clock=clock, wall_clock=wall_clock)
        s = self.settings
        self.runtime = CoreRuntime(
            s,
            quiesce=self.quiesce,
            metadata=self.metadata,
            checkpoint_components=self.checkpoint_components,
            eviction=self.eviction,
            wall_clock=wall_clock,
            timers=[
                ("health-sweep", s.health_check_interval, self.sweep_membership),
                (
                    "checkpoint",
                    s.checkpoint_interval if s.checkpoint_path else 0.0,
                    self.checkpoint_now,
                ),
                ("eviction", s.eviction_check_interval, self.run_eviction),
                ("fence-sweep", s.fence_sweep_interval, self.sweep_fences),
                ("resync", s.resync_retry_interval, self.resync.tick),
            ],
        )

    # -- lifecycle -----------------------------------------------------------

    def load_state(self) -> LoadReport | None:
        """Load metadata, then the checkpoint, once; None without a checkpoint path."""
        return self.runtime.load_state()

    def start(self) -> None:
        """Load state if not done yet, arm the eviction readiness gate, start the timers.

        Every emitter the loaded state names counts as heard from now: a node
        re-registers only once the coordinator serves, however long the
        checkpoint took to load (:meth:`sweep_unregistered`).
        """
        self.runtime.start()
        self.started = self.clock()
        self.gate.hear_all()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the timers, then write the final checkpoint (when a path is set). Idempotent.

        A coordinator whose state was never loaded writes no checkpoint: its
        empty state would overwrite the good one on disk.
        """
        self.runtime.stop(timeout)

    @property
    def timers(self) -> tuple[PeriodicTask, ...]:
        """Running periodic tasks."""
        return self.runtime.timers

    def sweep_fences(self, max_slices: int = 64) -> int:
        """Sweep records of large fences in slices of 1024 keys; returns the keys left.

        Each slice holds the directory lock for a few milliseconds, so ingest
        and lookups interleave with a long sweep.
        """
        left = self.directory.reclaim_fenced(_SWEEP_SLICE)
        for _ in range(max_slices - 1):
            if not left:
                break
            left = self.directory.reclaim_fenced(_SWEEP_SLICE)
        return left

    def checkpoint_now(self, timeout: float | None = None) -> CheckpointResult:
        """Capture under quiesce and write the checkpoint now; failures are in the result.

        Raises FailedPrecondition when no checkpoint path is configured.
        """
        return self.runtime.checkpoint_now(timeout)

    # -- ingest ----------------------------------------------------------------

    def ingest(self, batch: CacheEventBatch) -> IngestResult:
        """Validate then ingest one batch (InvalidArgument when malformed)."""
        validate_batch(batch)
        return self.gate.ingest(batch)

    def ingest_validated(self, batch: CacheEventBatch) -> IngestResult:
        """Ingest a batch the caller already passed through ``validate_batch`` (fast path)."""
        return self.gate.ingest(batch)

    def ingest_batches(
        self, batches: Sequence[CacheEventBatch], *, validated: bool = False
    ) -> IngestSummary:
        """Validate every batch first (nothing is applied if one is bad), then ingest in order."""
        if not validated:
            for i, batch in enumerate(batches):
                validate_batch(batch, field_prefix=f"batches[{i}]")
        return self.gate.ingest_batches(batches)

    def cursors(self) -> dict[str, CursorInfo]:
        """Per-emitter stream cursors, gap flags and admission counters."""
        return self.gate.cursors()

    def stream_opened(self, instance_id: str) -> bool:
        """A node opened its event stream: resync it when the gate has no cursor for it.

        Returns True when a resync was sent (see :mod:`.resync`, trigger 3).
        """
        return self.resync.stream_opened(instance_id, known=self.gate.has_cursor(instance_id))

    def consumer_stats(self) -> dict[str, ConsumerStats]:
        """Per-consumer delivery counters."""
        return self.broadcaster.stats()

    # -- directory -------------------------------------------------------------

    def lookup(self, keys: Sequence[ObjectKey], *, with_tokens: bool = True) -> list[KeyInfo]:
        """Placements (and tokens, access counts) of each key, in request order."""
        return self.directory.lookup(keys, with_tokens=with_tokens)

    def lookup_tokens(
        self,
        model_name: str,
        world_size: int,
        cache_salt: str,
        token_ids: Sequence[int] | np.ndarray,
        *,
        with_tokens: bool = True,
    ) -> TokenLookup:
        """Resolve tokens to keys, expand across object groups, look each up.

        See docs/coordinator.md, "Token lookups".
        """
        return tokens.lookup_tokens(
            self.hasher,
            self.directory,
            model_name,
            world_size,
            cache_salt,
            token_ids,
            with_tokens=with_tokens,
        )

    def blend_lookup(
        self,
        model: str,
        world_size: int,
        salt: str,
        prompt: Sequence[int] | np.ndarray,
        stride: int = 0,
    ) -> tuple[list[BlendMatch], int]:
        """CacheBlend segments held somewhere inside a prompt (docs/blend.md, "The fleet's
        blend index"); ``stride`` 0: the configured probe stride."""
        stride = stride or self.settings.blend_probe_stride
        return self.blend.lookup(model, world_size, salt, prompt, stride)

    def score_engines(
        self,
        *,
        model_name: str,
        token_ids: Sequence[int] | np.ndarray = (),
        chunk_hashes: Sequence[bytes] = (),
        cache_salt: str = "",
        lora_name: str = "",
        lora_id: int = 0,
        world_size: int = 1,
        engine_ids: Sequence[str] = (),
        weights: scoring.TierWeights | None = None,
    ) -> scoring.ScoreResult:
        """Per engine, the prompt's prefix it could use, by tier (docs/routing.md)."""
        hashes = scoring.prompt_hashes(self.hasher, token_ids, chunk_hashes)
        return scoring.score_engines(
            self.engines,
            self.directory,
            hashes,
            chunk_size=self.settings.chunk_size,
            model_name=model_name,
            cache_salt=salt_with_lora(cache_salt, lora_name, lora_id),
            world_size=world_size,
            engine_ids=engine_ids,
            weights=weights or scoring.TierWeights(*self.settings.score_weights),
        )

    def list_keys(
        self,
        *,
        tier: Tier | None = None,
        instance_id: str = "",
        backend: str = "",
        limit: int = DEFAULT_LIST_LIMIT,
        page_token: str = "",
    ) -> KeyPage:
        """A page of the directory (see :meth:`KeyDirectory.list_keys`)."""
        return self.directory.list_keys(
            tier=tier, instance_id=instance_id, backend=backend, limit=limit, page_token=page_token
        )

    def stats(self) -> DirectoryStats:
        """Directory totals (O(1) in the number of keys)."""
        return self.directory.stats()

    def status(self) -> CoordinatorStatus:
        """Everything an operator's status view shows."""
        return coordinator_status(self, self.runtime)

    # -- membership ------------------------------------------------------------

    def register_instance(
        self,
        instance_id: str,
        *,
        incarnation: int = 0,
        endpoints: Endpoints | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Registration:
        """Register (or re-register) a node; an empty id gets a generated one.

        Touches neither the gate cursor nor capacity (a restart is detected
        by the incarnation of the node's events).
        """
        iid = instance_id.strip() or f"kvm-{uuid.uuid4().hex}"
        existed = self.registry.register(
            iid, incarnation=incarnation, endpoints=endpoints, metadata=metadata
        )
        return Registration(iid, existed)

    def heartbeat(self, instance_id: str) -> None:
        """Record a heartbeat; NotFound (meaning: register again) for an unknown id."""
        if not self.registry.update_heartbeat(instance_id):
            raise NotFound(
                f"unknown instance {instance_id}; re-register",
                reason="INSTANCE_NOT_REGISTERED",
                metadata={"instance_id": instance_id},
            )

    def deregister_instance(self, instance_id: str) -> bool:
        """Remove a node, fence its L1 and forget its cursor and capacity; True if it was known.

        The fence and forget run even for an unknown id (idempotent cleanup).
        """
        existed = self.registry.deregister(instance_id) is not None
        # The planner first: a batch that lands between the two starts a fresh cursor
        # that must not count as covered by a resync sent before the fence.
        self.resync.instance_dropped(instance_id)
        self.gate.drop_instance(instance_id)
        self.capacity.forget(instance_id)
        return existed

    def list_instances(self) -> list[InstanceInfo]:
        """Every registered node, sorted by id."""
        return self.registry.all_instances()

    def sweep_membership(self) -> None:
        """The health sweep: nodes whose heartbeat expired, then unregistered quiet ids."""
        self.sweep_stale_instances()
        self.sweep_unregistered()

    def sweep_stale_instances(self) -> list[str]:
        """Reap nodes whose heartbeat expired: deregister, fence L1, forget cursor and capacity."""
        removed = evict_stale(self.registry, self.settings.instance_timeout)
        for iid in removed:
            self.resync.instance_dropped(iid)  # first, as in deregister_instance
            self.gate.drop_instance(iid)
            self.capacity.forget(iid)
        return removed

    def sweep_unregistered(self) -> list[str]:
        """Drop what is held of ids neither registered nor heard from for ``instance_timeout``.

        Cursors, capacity and L1 placements can outlive a node's registration:
        a checkpoint restores them for nodes that never come back (a node
        replaced under a new id while the coordinator was down), and an event
        that arrives after a deregistration starts them again. A node that
        lives re-registers within two heartbeats of the coordinator's start,
        and an emitter that never registers (a tool feeding ``IngestBatches``)
        keeps its state while it sends; any other id is dropped as a node
        whose heartbeat expired is (docs/coordinator.md, "Membership").
        Returns the ids dropped.
        """
        timeout = self.settings.instance_timeout
        held = (
            set(self.gate.cursors())
            | set(self.capacity.get_all())
            | set(self.usage.get_bytes_by_instance(Tier.L1))
        )
        held.discard("")  # shared L1 pools: usage owned by no node
        dropped: list[str] = []
        for iid in sorted(held):
            if self.registry.contains(iid) or not self.gate.is_quiet(
                iid, timeout, since=self.started
            ):
                continue
            self.resync.instance_dropped(iid)  # first, as in deregister_instance
            if self.gate.drop_if_quiet(iid, timeout, since=self.started):
                self.capacity.forget(iid)
                dropped.append(iid)
        if dropped:
            logger.warning(
                "Dropped the state of %d unregistered id(s) not heard from for over %.1fs: %s",
                len(dropped),
                timeout,
                ", ".join(dropped[:8]) + (" ..." if len(dropped) > 8 else ""),
            )
        return dropped

    # -- usage (read models in .reports) -----------------------------------------

    def instance_usage(self, instance_id: str) -> InstanceMemoryStatus:
        """Memory view of one node; NotFound if unregistered with no bytes and no declaration."""
        status = reports.instance_status(self.registry, self.capacity, self.usage, instance_id)
        if status is None:
            raise NotFound(f"unknown instance {instance_id}", metadata={"instance_id": instance_id})
        return status

    def fleet_usage(self) -> FleetMemoryStatus:
        """Every node that is registered, holds bytes or declared capacity, plus shared pools."""
        return reports.fleet_status(self.registry, self.capacity, self.usage)

    def usage_by_salt(self, tier: Tier) -> dict[str, int]:
        """Bytes per salt on ``tier``."""
        return self.usage.get_bytes_by_salt(tier)

    def quota_status(self, cache_salt: str, tier: Tier = Tier.L2) -> QuotaStatus:
        """Quota (L2 only) and usage of one salt."""
        return reports.quota_status(self.usage, self.quotas, cache_salt, tier)

    def list_quota_status(self, tier: Tier = Tier.L2) -> QuotaListing:
        """Status of every salt with usage on ``tier`` or (L2) a quota, sorted by salt."""
        return reports.quota_listing(self.usage, self.quotas, tier)

    # -- eviction ----------------------------------------------------------------

    def plan_eviction(self) -> dict[str, list[ObjectKey]]:
        """The pure plan (victims per salt over quota), without sending anything."""
        return self.eviction.compute_eviction_plan()

    def run_eviction(self, *, dry_run: bool = False) -> EvictionReport:
        """One eviction cycle: plan and dispatch deletes (nothing before readiness).

        With ``dry_run`` only the plan is computed (allowed before readiness).
        """
        return self.eviction.execute_evictions(dry_run=dry_run)

    def delete_keys(
        self,
        keys: Sequence[ObjectKey],
        *,
        instance_id: str = "",
        tier: Tier | None = None,
        force: bool = False,
    ) -> DeleteKeysResult:
        """Delete keys (and their other object groups) through the nodes' command streams.

        ``tier`` None means both tiers. With ``instance_id`` the delete goes
        to that node for every adapter of the tier (NotFound if it is not
        registered, Unavailable if it took none of the requests); without,
        to every live node that holds a copy, naming the copy's backend.
        Pinned keys are skipped unless ``force`` when L2 is included; a
        forced L2 delete also drops their pins (persisted). Effects show up
        when the nodes report the DELETE events.
        """
        return deletes.delete_keys(self, keys, instance_id=instance_id, tier=tier, force=force)

    def delete_tokens(
        self,
        model_name: str,
        world_size: int,
        cache_salt: str,
        token_ids: Sequence[int] | np.ndarray,
        *,
        instance_id: str = "",
        tier: Tier | None = None,
        force: bool = False,
    ) -> DeleteKeysResult:
        """:meth:`delete_keys` of every key of a token sequence (resolved locally).

        See docs/coordinator.md, "Token lookups".
        """
        deletes.require_instance(self, instance_id)
        keys, _chunks = tokens.resolve_token_keys(
            self.hasher, model_name, world_size, cache_salt, token_ids
        )
        if not keys:
            return DeleteKeysResult(0, 0, 0)
        return self.delete_keys(keys, instance_id=instance_id, tier=tier, force=force)

    def mark_eviction_ready(self) -> None:
        """Lift the eviction readiness gate now (operator override)."""
        self.eviction.mark_ready()
