"""The coordinator core's components, built and wired in one fixed order.

Wiring (fixed, no plug-in discovery):

* ``EventGate`` → ``CacheEventBroadcaster`` → consumers, registered in this
  order, which is load-bearing:

  1. ``KeyDirectory`` — owns placements and, inside its own ``consume`` /
     ``fence_instance``, applies the resulting byte changes to the
     ``CacheUsageManager`` (the usage view is therefore always updated
     before anything registered after the directory runs);
  2. ``ServerConfigRegistry`` — capacity declarations (CONFIG batches);
  3. ``FleetEvictionController`` — L2 LRU; on DELETE it asks whether any L2
     copy remains, which needs the directory and usage already updated.
  4. ``BlendIndex`` — CacheBlend segments by their first tokens; reads the
     directory's placements at lookup time only.

* ``Engines`` (vLLM engines' own caches, fed by the coordinator's event
  subscriber, read by scoring) is not a consumer either.
* ``InstanceRegistry`` is not a consumer. Deregistration and heartbeat
  expiry both call ``EventGate.drop_instance`` (fence L1 everywhere, forget
  the cursor) **and** ``ServerConfigRegistry.forget``, and tell the
  ``ResyncPlanner``; so does the sweep of ids that are neither registered
  nor heard from (``EventGate.drop_if_quiet``).
* Resyncs: the gate tells the :class:`~.resync.ResyncPlanner` about every
  fresh cursor and every seq gap.
* Persistence: checkpoint sections ``stream_cursors``, ``key_directory``,
  ``server_config``, ``lru_order`` (:attr:`CoreComponents.checkpoint_components`);
  metadata sections ``pins`` and ``quotas`` (registered with the
  :class:`~.persistence.MetadataStore`).

The :class:`~.coordinator.Coordinator` facade builds on this and adds the
runtime (loading, saving, timers) and the servicers' typed API.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmesh.common.hashing import TokenHasher

from .blendindex import BlendIndex
from .broadcaster import CacheEventBroadcaster
from .capacity import ServerConfigRegistry
from .commands import CommandLedger
from .directory import KeyDirectory
from .engines import Engines
from .eviction import DeleteDispatcher, FleetEvictionController
from .gate import EventGate
from .keyspace import KeySpaces
from .lru import IsolatedLRU
from .membership import InstanceRegistry
from .persistence import DurableComponent, MetadataStore
from .pins import PinTable
from .quiesce import QuiesceLock
from .quotas import QuotaManager
from .resync import ResyncDispatcher, ResyncPlanner
from .settings import CoordinatorSettings
from .usage import CacheUsageManager


class CoreComponents:
    """Every coordinator component, constructed and wired (see the module docstring)."""

    def __init__(
        self,
        settings: CoordinatorSettings | None = None,
        *,
        dispatcher: DeleteDispatcher | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = s = settings if settings is not None else CoordinatorSettings()
        self.clock = clock
        #: When this coordinator was built, then when it started serving (``clock``):
        #: an id it holds state of without ever hearing from it counts as quiet since.
        self.started = clock()
        self.hasher = TokenHasher(s.chunk_size)
        self.spaces = KeySpaces()
        self.usage = CacheUsageManager()
        self.directory = KeyDirectory(
            self.spaces, self.usage, token_binding_cap=s.token_binding_cap
        )
        self.capacity = ServerConfigRegistry()
        self.registry = InstanceRegistry(clock=clock, wall_clock=wall_clock)
        self.quotas = QuotaManager()
        self.pins = PinTable()
        self.lru = IsolatedLRU(self.spaces)
        self.eviction = FleetEvictionController(
            self.spaces,
            self.directory,
            self.usage,
            quotas=self.quotas,
            pins=self.pins,
            lru=self.lru,
            is_live=self.registry.contains,
            dispatcher=dispatcher,
            eviction_ratio=s.eviction_ratio,
            trigger_watermark=s.trigger_watermark,
            max_delete_batch=s.max_delete_batch,
            max_victims_per_cycle=s.max_victims_per_cycle,
            ready_delay=s.heartbeat_interval,
            redispatch_after=s.redispatch_after,
            clock=clock,
        )
        self.broadcaster = CacheEventBroadcaster()
        # Order is load-bearing; see the module docstring.
        self.broadcaster.register(self.directory)
        self.broadcaster.register(self.capacity)
        self.broadcaster.register(self.eviction)
        self.blend = BlendIndex(self.directory, enabled=s.enable_blend_lookup)
        self.broadcaster.register(self.blend)
        self.quiesce = QuiesceLock()
        # Engines' own caches, from their vLLM KV events (not a broadcaster consumer).
        self.engines = Engines(s.chunk_size)
        self.commands = CommandLedger(wall_clock=wall_clock)
        self.resync = ResyncPlanner(
            dispatcher=dispatcher if isinstance(dispatcher, ResyncDispatcher) else None,
            min_interval=s.resync_min_interval,
            clock=clock,
        )
        self.gate = EventGate(
            self.broadcaster,
            self.quiesce,
            wall_clock=wall_clock,
            clock=clock,
            on_cursor=self.resync.cursor_event,
        )
        self.metadata = MetadataStore(s.metadata_path or None, wall_clock=wall_clock)
        self.metadata.register(self.pins)
        self.metadata.register(self.quotas)
        self.checkpoint_components: list[DurableComponent] = [
            self.gate,
            self.directory,
            self.capacity,
            self.lru,
        ]

    def set_delete_dispatcher(self, dispatcher: DeleteDispatcher | None) -> None:
        """Wire (or unwire) how deletes (and, if it can, resyncs) reach the nodes."""
        self.eviction.dispatcher = dispatcher
        self.resync.dispatcher = dispatcher if isinstance(dispatcher, ResyncDispatcher) else None
