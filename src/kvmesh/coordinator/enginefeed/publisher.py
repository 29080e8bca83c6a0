"""Re-publish what kvmesh's tiers hold as vLLM KV events, for routers that read those.

A broadcaster consumer: every admitted STORE and DELETE batch of a storage
node becomes a vLLM-format batch (docs/routing.md), sent on the
coordinator's own ZMQ PUB socket, with a ROUTER replay socket that answers
vLLM's replay protocol from a buffer of recent batches:

- topic ``{prefix}@{instance_id}@{model_name}`` (one node, one model; a ZMQ
  subscription is a prefix match, so ``{prefix}@{instance_id}@`` follows a
  node);
- ``BlockStored`` per chunk: ``block_hashes`` the first 8 bytes of kvmesh's
  chunk hash as an unsigned big-endian integer (vLLM's default form),
  ``block_size`` the chunk size, ``token_ids`` the chunk's tokens when the
  node sent them, ``parent_block_hash`` the previous chunk of the same batch
  when it directly precedes this one (else nil: kvmesh's hash is chained, so
  a block hash alone names the whole prefix), ``medium`` ``KVMESH_L1`` or
  ``KVMESH_L2``;
- ``BlockRemoved`` for deletes; ``AllBlocksCleared`` when a node's L1 is
  fenced (it restarted or was dropped), on each of its topics.

Only the first kv rank's keys are published: a vLLM event describes an
engine, not one of its tensor-parallel workers. Sockets live in one thread;
``consume`` only queues (it runs under the coordinator's gate lock).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from kvmesh.common.errors import FailedPrecondition
from kvmesh.common.events import CacheEventBatch, EventType, Tier
from kvmesh.common.keys import kv_rank_world_size, worker_kv_rank
from kvmesh.coordinator.core.engineevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
    encode_batch,
    encode_seq,
)

logger = logging.getLogger(__name__)

MEDIUM = {Tier.L1: "KVMESH_L1", Tier.L2: "KVMESH_L2"}


def _bind(sock: zmq.Socket[bytes], endpoint: str, field: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise FailedPrecondition(f"{field}: cannot bind {endpoint}: {exc}") from None


def block_hash(chunk_hash: bytes) -> int:
    """The vLLM-style integer block hash of a kvmesh chunk hash."""
    return int.from_bytes(chunk_hash[:8], "big")


class TierPublisher:
    """Broadcaster consumer that publishes kvmesh's placements as vLLM KV events."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str = "",
        topic_prefix: str = "kvmesh",
        chunk_size: int,
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic_prefix = topic_prefix
        self.chunk_size = chunk_size
        self.hwm = hwm
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.SimpleQueue[tuple[bytes, EventBatch] | None] = queue.SimpleQueue()
        self._models: dict[str, set[str]] = {}
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.published = 0

    # -- lifecycle -----------------------------------------------------------

    def bind(self) -> None:
        """Bind both sockets (FailedPrecondition naming the endpoint; nothing left open)."""
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, self.hwm)
            _bind(self._pub, self.endpoint, "publish_events_endpoint")
            if self.replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                _bind(self._router, self.replay_endpoint, "publish_events_replay_endpoint")
        except BaseException:
            self.stop()
            raise

    def start(self) -> None:
        """Publish from a thread (after :meth:`bind`)."""
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if not self._ctx.closed:
            self._ctx.term()

    def bound_endpoint(self) -> str:
        """The PUB socket's address (resolves a port 0)."""
        assert self._pub is not None
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    def bound_replay_endpoint(self) -> str:
        assert self._router is not None
        return str(self._router.getsockopt_string(zmq.LAST_ENDPOINT))

    # -- broadcaster consumer ------------------------------------------------

    def consume(self, batch: CacheEventBatch) -> None:
        if batch.event_type not in (EventType.STORE, EventType.DELETE):
            return
        medium = MEDIUM.get(Tier(batch.tier))
        if medium is None:
            return
        by_model: dict[str, list[EngineEvent]] = {}
        previous: tuple[str, str, int, bytes] | None = None
        for entry in batch.entries:
            key = entry.key
            if key.kv_rank != worker_kv_rank(max(kv_rank_world_size(key.kv_rank), 1), 0):
                continue
            events = by_model.setdefault(key.model_name, [])
            if batch.event_type == EventType.DELETE:
                events.append(BlockRemoved((block_hash(key.chunk_hash),), medium))
                continue
            parent = None
            offset = entry.token_offset
            if previous is not None and offset > 0:
                model, salt, prev_offset, prev_hash = previous
                if (model, salt) == (key.model_name, key.cache_salt) and (
                    prev_offset + self.chunk_size == offset
                ):
                    parent = block_hash(prev_hash)
            tokens = tuple(entry.token_ids) if len(entry.token_ids) == self.chunk_size else ()
            events.append(
                BlockStored(
                    (block_hash(key.chunk_hash),),
                    parent,
                    tokens,
                    self.chunk_size,
                    medium=medium,
                )
            )
            previous = (key.model_name, key.cache_salt, offset, key.chunk_hash)
        for model, events in by_model.items():
            self._models.setdefault(batch.instance_id, set()).add(model)
            topic = self._topic(batch.instance_id, model)
            self._queue.put((topic, EventBatch(batch.ts, tuple(events))))

    def fence_instance(self, instance_id: str) -> None:
        for model in sorted(self._models.get(instance_id, ())):
            batch = EventBatch(time.time(), (AllBlocksCleared(),))
            self._queue.put((self._topic(instance_id, model), batch))

    def _topic(self, instance_id: str, model: str) -> bytes:
        return f"{self.topic_prefix}@{instance_id}@{model}".encode()

    # -- the sockets' thread -------------------------------------------------

    def _run(self) -> None:
        seq = 0
        while True:
            if self._router is not None and self._router.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            topic, batch = item
            payload = encode_batch(batch)
            assert self._pub is not None
            try:
                self._pub.send_multipart((topic, encode_seq(seq), payload))
            except zmq.ZMQError:
                logger.exception("could not publish a KV event batch")
            self._buffer.append((seq, topic, payload))
            seq += 1
            self.published = seq

    def _serve_replay(self) -> None:
        assert self._router is not None
        frames = self._router.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big", signed=True)
        for seq, topic, payload in list(self._buffer):
            if seq >= first:
                self._router.send_multipart((client, b"", topic, encode_seq(seq), payload))
        self._router.send_multipart((client, b"", b"", encode_seq(-1), b""))
