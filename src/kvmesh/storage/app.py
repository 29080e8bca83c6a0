"""The storage node as a service: core, servicer, event emitter and registrar.

Start-up order matters for fencing: the incarnation is taken (and persisted)
before anything is reported, the emitter exists before the storage core so
the very first placement change (the L2 index announced at start) is
reported, and the registrar re-declares capacity after every (re-)
registration.

Concurrency model
-----------------
Every RPC runs on the event loop (the main thread), and no RPC ever holds a
thread while it waits. A ``wait_timeout_ms`` of LookupAndLock or
GetPrefetchStatus awaits an asyncio future. The prefetch worker resolves it
through ``loop.call_soon_threadsafe`` when the prefetch finishes. An
abandoned prefetch gives its locks back from the same done callback. The
only blocking work an RPC hands off is its copy (the gather of StoreChunks,
the scatter of RetrieveChunks). That copy runs on the node's own copy
executor, ``kvmesh-transfer``, made here with the ``copy_threads`` setting's
threads (0, the default: one per core, 2 to 8; one store's copy is split
over ``store_copy_threads`` threads, by default 1). So a copy never queues
behind a wait, an L2 call or start-up work. The same executor maps a newly
registered engine's KV memory once (``TransferEngine.prefault``, about 0.3 s
per GiB), so the engine's first loads fault no page, and before the first
registration it imports torch and the copy code (``StorageNode.load_copies``):
a node serves without torch, which takes 0.35 s of CPU to start instead of
1.2 s, and the import does not stall the loop. The storage code never uses the
loop's default executor: one-off blocking calls (loading the copy kernel,
closing the event transport) get a thread that ends with them. With
``realtime_priority`` the loop's thread and the copy executors' threads run
under ``SCHED_FIFO``; nothing else does (``kvmesh.common.thread_priority``).

Threads of an idle storage node (20 on 2 cores in ``kvmesh up --nodes 1``,
with a coordinator and a 1 GiB L1; ``ls /proc/PID/task | wc -l``):

- the event loop (main thread);
- gRPC core: 4 event-engine workers, a timer and a lifeguard, plus the
  grpc.aio poller (7, gRPC's own);
- the Prometheus ``/metrics`` HTTP server (unless the metrics port is -1);
- OpenBLAS: one per extra core, started by importing numpy;
- with a coordinator, the event pipeline: the emitter's flusher and sender,
  the event stream's reader, gRPC's own two threads of the stream and of
  the membership calls, and the registrar's heartbeat;
- the L1 and L2 eviction loops (2);
- the L2 write-through dispatcher ``kvmesh-l2-store`` (with an L2 adapter);
- the L1 pool grower (while L1 is not fully mapped).

Started on first use and then kept, each up to its bound: the copy
executor, the prefetch workers ``kvmesh-prefetch``
(``prefetch_max_in_flight``: they block on L2 I/O, never on a waiter),
the write-through I/O pool ``kvmesh-l2-put`` (one per adapter), the P2P
data plane's senders ``kvmesh-p2p-send`` (one per stream served to a peer,
up to 8: a blocking ``sendall`` from L1 memory, see
``kvmesh.storage.peers.dataplane``) and the P2P fetchers ``kvmesh-p2p``
(``p2p_max_in_flight``), the copy
kernel's helpers ``kvmesh-copy`` (large CPU copies, see
``kvmesh.kernels.ops``) and an S3 adapter's I/O pool. Short-lived: the L2
indexing thread at start, and the coordinator command handler while
commands are queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
from prometheus_client.registry import Collector

from kvmesh.api.storage.v1 import storage_pb2, storage_pb2_grpc
from kvmesh.common.config import ConfigError
from kvmesh.common.errors import Unavailable
from kvmesh.common.thread_priority import realtime_initializer, serve_this_thread_in_realtime
from kvmesh.kernels import native
from kvmesh.rpc.metrics import StatsCollector
from kvmesh.rpc.server import ServiceBinding
from kvmesh.storage.config import StorageConfig
from kvmesh.storage.core.controllers.prefetch_types import PrefetchPolicy
from kvmesh.storage.core.controllers.store import StorePolicy
from kvmesh.storage.core.copies import default_copy_threads
from kvmesh.storage.core.incarnation import InstanceLock, next_incarnation
from kvmesh.storage.core.l1.pool import reclaim_dead_pools
from kvmesh.storage.core.l2.base import L2Adapter
from kvmesh.storage.core.l2.factory import build_l2_adapter
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.node import StorageNode
from kvmesh.storage.core.options import StorageOptions
from kvmesh.storage.core.ports import NodeCommand
from kvmesh.storage.core.transfer.engine import TransferEngine
from kvmesh.storage.events.config import EmitterConfig
from kvmesh.storage.events.emitter import CacheEventEmitter
from kvmesh.storage.events.registrar import Registrar, Registration
from kvmesh.storage.events.sink import EmitterSink
from kvmesh.storage.events.transport import EventTransport
from kvmesh.storage.metrics import SERIES, flat_stats
from kvmesh.storage.peers.wiring import PeerWiring
from kvmesh.storage.servicer import StorageServicer

logger = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE_NAME = "kvmesh.storage.v1.StorageService"
#: A health-only name (no gRPC service): SERVING while the node's event link to its
#: coordinator is up, NOT_SERVING while it is down. A node without a coordinator does
#: not serve it (Check answers NOT_FOUND). It leaves the overall status and
#: StorageService alone: the node serves its engines with or without a coordinator.
COORDINATOR_LINK = "kvmesh.storage.v1.CoordinatorLink"
#: How often the node looks at its event link (a lock and a flag; no network).
LINK_CHECK_SECONDS = 0.25


async def _on_own_thread(name: str, fn: Callable[..., T], *args: Any) -> T:
    """Run a one-off blocking call on a thread that ends with it (never the default executor)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    finally:
        pool.shutdown(wait=False)


def serve_loop_in_realtime(priority: int) -> None:
    """Put the calling thread (the event loop's) under ``SCHED_FIFO`` at ``priority``.

    0 does nothing. A node that may not do it refuses to start, naming what
    it lacks, rather than serve at a priority its operator did not ask for.
    """
    if not priority:
        return
    try:
        serve_this_thread_in_realtime(priority)
    except OSError as exc:
        raise ConfigError(
            f"realtime_priority {priority}: this process may not use SCHED_FIFO "
            f"({exc.strerror or exc}); it needs CAP_SYS_NICE (root, or docker run --cap-add "
            f"SYS_NICE) or an RLIMIT_RTPRIO of at least {priority}, or realtime_priority 0"
        ) from exc
    logger.info("event loop and copy threads under SCHED_FIFO, priority %d", priority)


def check_shm_space(shm_dir: str, l1_size_bytes: int) -> None:
    """Refuse at start an L1 larger than the free space of its shared-memory directory.

    L1 grows lazily, so without this a too large ``l1_size_bytes`` would start
    and fail much later, when the pool grows. Segments of dead nodes are
    reclaimed first: their space is free for this one.
    """
    path = Path(shm_dir)
    if path.is_dir():
        reclaim_dead_pools(shm_dir)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError as exc:
        raise ConfigError(f"shm_dir {shm_dir}: {exc.strerror or exc}") from exc
    free = st.f_bavail * st.f_frsize
    if l1_size_bytes > free:
        raise ConfigError(
            f"l1_size_bytes {l1_size_bytes} ({l1_size_bytes / 1024**3:.1f} GiB) is larger than "
            f"the free space of {shm_dir} ({free / 1024**3:.1f} GiB); lower --l1-size-bytes "
            "or give --shm-dir a larger tmpfs"
        )


class _DeferredHandler:
    """Commands arrive on the stream the emitter opens before the node exists."""

    def __init__(self) -> None:
        self.node: StorageNode | None = None

    def handle_command(self, command: NodeCommand) -> int:
        if self.node is None:
            raise Unavailable("the storage node is still starting")
        return self.node.handle_command(command)


class StorageApp:
    """ServiceApp of a storage node."""

    name = "storage"

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        # Built on the event loop's thread: that thread serves every RPC (and the lane).
        serve_loop_in_realtime(config.realtime_priority)
        # ``kvmesh storage --port 0`` picks its port before the app is built, so the
        # default id names the real port; only a unix-socket node falls back to a path.
        self.instance_id = config.instance_id or (
            config.resolved_instance_id(config.port)
            if config.port
            else f"storage-{socket.gethostname()}-{config.unix_socket or 'local'}".replace("/", "_")
        )
        self.data_dir = config.resolved_data_dir(self.instance_id)
        # Before anything else touches the state directory: a second process of the
        # same instance must fail without rewriting the running one's incarnation.
        check_shm_space(config.shm_dir, config.l1_size_bytes)
        self._instance_lock = InstanceLock(self.data_dir, self.instance_id)
        self._event_transport: EventTransport | None = None
        adapters: list[L2Adapter] = []
        try:
            for i, spec in enumerate(config.l2_configs(self.data_dir)):
                adapters.append(build_l2_adapter(spec, path=f"l2[{i}]"))
            # Only a start that got this far advances the incarnation.
            self.incarnation = next_incarnation(self.data_dir)
            logger.info(
                "storage node %s, incarnation %d, data in %s",
                self.instance_id,
                self.incarnation,
                self.data_dir,
            )
            self.manager = self._build(config, adapters)
        except BaseException:
            for adapter in adapters:
                adapter.close()
            close_transport = getattr(self._event_transport, "close", None)
            if close_transport is not None:
                close_transport()
            self._instance_lock.release()
            raise
        # Past this point the manager owns the adapters and L1 (stop() closes them).
        try:
            self._finish(config)
        except BaseException:
            self.manager.close()
            close_transport = getattr(self._event_transport, "close", None)
            if close_transport is not None:
                close_transport()
            self._instance_lock.release()
            raise

    def _build(self, config: StorageConfig, adapters: list[L2Adapter]) -> StorageManager:
        """The event pipeline and the storage manager (L1 and ``adapters``)."""
        self.emitter: CacheEventEmitter | None = None
        self._sink: EmitterSink | None = None
        self.registrar: Registrar | None = None
        self._handler = _DeferredHandler()
        self._sweeper: asyncio.Task[None] | None = None
        self._link_watcher: asyncio.Task[None] | None = None
        self._report: Callable[[str, bool], None] | None = None
        #: Whether the event link to the coordinator is up (False until it first is).
        self.coordinator_connected = False
        self._link_target = ""
        sink = None
        if config.event_transport == "nats":
            # nats-py is an optional dependency (the "nats" extra).
            from kvmesh.storage.events.jetstream import StreamSettings
            from kvmesh.storage.events.nats_transport import NatsEventTransport

            self._event_transport = NatsEventTransport(
                config.nats_url,
                stream=StreamSettings(
                    name=config.nats_stream, max_age_s=config.nats_max_age_seconds
                ),
            )
        elif config.coordinator_target:
            from kvmesh.storage.events.grpc_transport import GrpcEventTransport

            self._event_transport = GrpcEventTransport(config.coordinator_target)
        if self._event_transport is not None:
            self._link_target = (
                f"NATS {config.nats_url}"
                if config.event_transport == "nats"
                else config.coordinator_target
            )
            self.emitter = CacheEventEmitter(
                EmitterConfig(
                    instance_id=self.instance_id,
                    incarnation=self.incarnation,
                    flush_interval_s=config.event_flush_ms / 1000.0,
                ),
                self._event_transport,
                command_handler=self._handler,
            )
            sink = self._sink = EmitterSink(self.emitter)
        options = StorageOptions(
            segment_bytes=config.segment_bytes(),
            initial_l1_bytes=config.l1_prefault_bytes or None,
            shm_dir=config.shm_dir,
            read_ttl_s=config.read_ttl_seconds,
            write_ttl_s=config.write_ttl_seconds,
            trigger_watermark=config.eviction_watermark,
            target_watermark=max(0.0, config.eviction_watermark - config.eviction_ratio),
            store_policy=StorePolicy(config.store_policy),
            prefetch_policy=PrefetchPolicy(config.prefetch_policy),
            prefetch_max_in_flight=config.prefetch_max_in_flight,
        )
        return StorageManager(
            self.instance_id,
            config.l1_size_bytes,
            l2_adapters=adapters,
            event_sink=sink,
            options=options,
        )

    def _finish(self, config: StorageConfig) -> None:
        """The transfer engine, the copy threads, the node and its servicer."""
        self.transfer = TransferEngine(config.allowed_memory_dir)
        # The data path's copies get threads of their own, sized here: nothing else
        # (waits, L2 I/O, start-up work) may ever queue a store or a retrieve. Loads
        # have threads apart from stores: an engine waits for a load before its next
        # forward pass, while a store runs after the answer (docs/architecture.md,
        # "Loads never wait behind stores").
        self.copy_threads = config.copy_threads or default_copy_threads()
        # With realtime_priority, the copies run in real time as the loop does.
        start = realtime_initializer(config.realtime_priority)
        self.copy_executor = ThreadPoolExecutor(
            max_workers=self.copy_threads, thread_name_prefix="kvmesh-transfer", initializer=start
        )
        self.load_executor = ThreadPoolExecutor(
            max_workers=self.copy_threads, thread_name_prefix="kvmesh-load", initializer=start
        )
        self.node = StorageNode(
            self.manager,
            self.transfer,
            max_chunks_per_request=config.max_chunks_per_request,
            copy_executor=self.copy_executor,
            load_executor=self.load_executor,
            store_copy_threads=config.store_copy_threads or None,
        )
        self._handler.node = self.node
        if self._sink is not None:  # segments' STORE events carry their heads
            self._sink.segment_of = self.node.segments.catalog.head_of
        self.servicer = StorageServicer(self.node, self.instance_id, self.incarnation)
        # P2P: the PeerService, and with a coordinator the fetch of local misses from peers.
        self.peers = PeerWiring(config, self.node, self.instance_id, self.incarnation)
        self.servicer.peer_status = self.peers.status
        if self.emitter is not None:
            self.servicer.emitter_status = self._emitter_status

    def _emitter_status(self) -> storage_pb2.EmitterStatus:
        assert self.emitter is not None
        stats = self.emitter.stats()
        return storage_pb2.EmitterStatus(
            connected=bool(getattr(stats, "connected", False)),
            incarnation=self.incarnation,
            last_seq=self.emitter.last_seq,
            last_acked_seq=int(getattr(stats, "acked_through_seq", 0)),
            unacked_batches=int(getattr(stats, "window_depth", 0)),
            dropped_batches=int(getattr(stats, "batches_dropped", 0)),
        )

    def bindings(self) -> Sequence[ServiceBinding]:
        def add(server: grpc.aio.Server) -> None:
            storage_pb2_grpc.add_StorageServiceServicer_to_server(self.servicer, server)

        return [ServiceBinding(SERVICE_NAME, add), self.peers.binding()]

    def collectors(self) -> Sequence[Collector]:
        return [
            StatsCollector(
                lambda: flat_stats(self.node, self.emitter),
                SERIES,
                const_labels={"instance_id": self.instance_id},
            ),
            self.peers.collector({"instance_id": self.instance_id}),
        ]

    def on_bound(
        self, storage_address: str, metrics_address: str, gateway_address: str = ""
    ) -> None:
        """Called once the server is bound: start talking to the coordinator."""
        storage_address = self.peers.advertise(storage_address)  # what peers dial (P2P)
        if not self.config.coordinator_target or self.registrar is not None:
            return
        from kvmesh.storage.events.grpc_membership import GrpcMembershipClient

        client = GrpcMembershipClient(
            self.config.coordinator_target,
            incarnation=self.incarnation,
            storage_address=storage_address,
            # The configured address wins: what clients dial, not what was bound (0.0.0.0).
            gateway_address=self.config.gateway_address or gateway_address,
            metrics_address=metrics_address,
        )
        self.registrar = Registrar(
            client,
            self.instance_id,
            heartbeat_interval_s=self.config.heartbeat_seconds,
            on_registered=self._on_registered,
        )

    def _on_registered(self, registration: Registration) -> None:
        # A (re-)registered node re-declares its capacity; the coordinator may be new.
        self.manager.publish_capacity()

    async def start(self) -> None:
        await self.peers.start()  # the P2P data plane's listener
        # Build or load the native copy kernel now, off the request path (the first
        # store would otherwise fall back to the slower NumPy copy while it compiles).
        library = await _on_own_thread("kvmesh-kernel-load", native.load)
        logger.info("copy kernel: %s", native.status() if library else "numpy fallback")
        if self.emitter is not None:
            self.emitter.start()
        if self.registrar is not None:
            self.registrar.start()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="storage-txn-sweeper")
        if self.emitter is not None:
            self._link_watcher = asyncio.create_task(
                self._link_loop(), name="storage-coordinator-link"
            )

    def watch_health(self, report: Callable[[str, bool], None]) -> None:
        """Called by the server once: ``report(service, serving)`` on every change."""
        if self.emitter is None:
            return  # no coordinator: CoordinatorLink is not served
        self._report = report
        report(COORDINATOR_LINK, self.coordinator_connected)

    def check_coordinator_link(self) -> bool:
        """Look at the event link once; log and report a change. Returns whether it is up."""
        assert self.emitter is not None
        stats = self.emitter.stats()
        connected = bool(getattr(stats, "connected", False))
        if connected != self.coordinator_connected:
            if connected:
                logger.info(
                    "event link to the coordinator at %s is up; %s is SERVING",
                    self._link_target,
                    COORDINATOR_LINK,
                )
            else:
                logger.warning(
                    "event link to the coordinator at %s is down (%s); %s reports NOT_SERVING "
                    "until it reconnects",
                    self._link_target,
                    getattr(stats, "last_error", "") or "no reason given",
                    COORDINATOR_LINK,
                )
            self.coordinator_connected = connected
            if self._report is not None:
                self._report(COORDINATOR_LINK, connected)
        return connected

    async def _link_loop(self) -> None:
        while True:
            try:
                self.check_coordinator_link()
            except Exception:
                logger.exception("checking the event link to the coordinator failed")
            await asyncio.sleep(LINK_CHECK_SECONDS)

    async def _sweep_loop(self) -> None:
        read_ttl, write_ttl = self.config.read_ttl_seconds, self.config.write_ttl_seconds
        # Half the gap between a lookup lease's end and its locks' lapse, at most: a
        # lease is ended (its locks released) before they lapse (docs/architecture.md).
        margin = read_ttl - self.node.lookups.leases.ttl_s
        period = max(0.05, min(read_ttl / 4, write_ttl / 4, margin / 2))
        while True:
            await asyncio.sleep(period)
            try:
                self.node.expire_transactions()
            except Exception:
                logger.exception("expiring engine-driven transactions failed")

    async def discard(self) -> None:
        """Release what construction took when the server could not be created (never started)."""
        await self.stop()

    async def stop(self) -> None:
        for task in (self._link_watcher, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.peers.close()
        self.node.close()
        # Running copies finish before L1 and the engines' mappings go away.
        self.copy_executor.shutdown(wait=True)
        self.load_executor.shutdown(wait=True)
        self.manager.close()
        self.transfer.close()
        if self.emitter is not None and not self.emitter.close(timeout=5.0):
            logger.warning("some cache events were not acknowledged before shutdown")
        if self.registrar is not None:
            # Last: the stores, write-throughs and evictions of the stop are reported
            # first. Events after the deregistration would put back placements of a
            # node the coordinator has dropped, where no sweep ever reaches them.
            await _on_own_thread("kvmesh-deregister", self.registrar.stop)
        close_transport = getattr(self._event_transport, "close", None)
        if close_transport is not None:
            # After the emitter: ends the transport's sessions, threads and event loop.
            await _on_own_thread("kvmesh-transport-close", close_transport)
        self._instance_lock.release()
