"""Follow engines' vLLM KV event streams into the coordinator's engine index.

One task per stream (engine x data-parallel rank), each with a ZMQ SUB
socket on the engine's endpoint and, when the engine has one, a DEALER to its
replay ROUTER. The stream's seq decides what a batch means (docs/routing.md):

- the next seq: applied;
- a seq at or below the last one: the engine restarted (vLLM's seq starts at
  0 with the process). Its blocks are dropped and, from the replay socket,
  everything the new process published is learned;
- a seq past the next one: a gap. Live batches wait in the socket while the
  missing ones are replayed; when the replay cannot cover the gap (no replay
  socket, or its buffer moved on), the stream's blocks are dropped and
  learned again from what the replay still holds and what comes next;
- a transport reconnect (the engine's socket went away and came back) is
  treated like a restart whose first batches may have been missed.

When a follower starts it replays from seq 0, so an engine that has been
serving for a while is known before it publishes again. Malformed frames
and batches are counted and skipped; they never stop the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvmesh.coordinator.core.engineevents import (
    EventFormatError,
    decode_batch,
    decode_seq,
    encode_seq,
)
from kvmesh.coordinator.core.engines import Engines, EngineSpec

logger = logging.getLogger(__name__)

#: Largest frame accepted from an engine (a batch of one step's events).
MAX_FRAME_BYTES = 64 << 20
#: Live batches the SUB socket keeps while a replay runs.
RECEIVE_HWM = 100_000
#: Seconds before a stream that failed is followed again.
RESTART_DELAY_S = 1.0


class EngineFeed:
    """Subscribes to every followed engine; restarts a follower when its spec changes."""

    def __init__(self, engines: Engines, *, replay_timeout: float = 5.0) -> None:
        self.engines = engines
        self.replay_timeout = replay_timeout
        self._ctx: zmq.asyncio.Context | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        #: Held by the stream applying a frame (see StreamFollower.run).
        self._turn = asyncio.Lock()

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._loop = asyncio.get_running_loop()
        self.engines.add_listener(self._changed)
        for spec in self.engines.specs():
            self._follow(spec.engine_id, spec)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _changed(self, engine_id: str, spec: EngineSpec | None) -> None:
        if self._loop is None:
            return
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            # At once: the old follower must not apply another batch after the
            # registry dropped the engine's blocks.
            self._follow(engine_id, spec)
        else:
            self._loop.call_soon_threadsafe(self._follow, engine_id, spec)

    def _follow(self, engine_id: str, spec: EngineSpec | None) -> None:
        for sid in [s for s in self._tasks if s[0] == engine_id]:
            self._tasks.pop(sid).cancel()
        if spec is None or self._ctx is None:
            return
        for rank in range(spec.data_parallel_size):
            follower = StreamFollower(
                self._ctx, self.engines, spec, rank, self.replay_timeout, self._turn
            )
            self._tasks[(engine_id, rank)] = asyncio.create_task(
                follower.supervise(), name=f"kv-events-{engine_id}-{rank}"
            )


class StreamFollower:
    """One engine stream: seq bookkeeping, replays, and applying batches."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        engines: Engines,
        spec: EngineSpec,
        rank: int,
        replay_timeout: float,
        turn: asyncio.Lock,
    ) -> None:
        self.ctx = ctx
        self.turn = turn
        self.engines = engines
        self.spec = spec
        self.rank = rank
        self.endpoint = spec.rank_endpoint(spec.endpoint, rank)
        self.replay_endpoint = spec.rank_endpoint(spec.replay_endpoint, rank)
        self.replay_timeout = replay_timeout
        self.last = -1
        #: Payload hashes of batches the last replay applied: the same batches
        #: may still be waiting in the SUB socket, and are not a restart.
        self._replayed: dict[int, int] = {}
        #: Frames and reconnects are handled one at a time.
        self._lock = asyncio.Lock()
        self.counts = {"incarnations": 0, "gaps": 0, "replays": 0, "batches": 0, "malformed": 0}

    async def supervise(self) -> None:
        """Follow the stream until cancelled; after a failure, start over (blocks dropped)."""
        while True:
            try:
                await self.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception(
                    "engine %s rank %d: event stream failed; following it again in %.0f s",
                    self.spec.engine_id,
                    self.rank,
                    RESTART_DELAY_S,
                )
            self._reset()
            self._report()
            await asyncio.sleep(RESTART_DELAY_S)

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        # The socket's reconnects are watched apart: one asyncio.Poller call per
        # frame would cost more than applying the frame.
        watcher = asyncio.create_task(self._watch(monitor))
        try:
            async with self._lock:
                await self._bootstrap()
            while True:
                frames = await sub.recv_multipart()
                async with self._lock:
                    await self._live(frames)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            with contextlib.suppress(Exception):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """A reconnect of the event socket (the engine went away and came back) is a restart."""
        lost_connection = False
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                lost_connection = True
            elif event["event"] == zmq.EVENT_CONNECTED and lost_connection:
                lost_connection = False
                async with self._lock:
                    await self._restarted("the event socket reconnected")

    async def _bootstrap(self) -> None:
        """Learn what the engine published before we subscribed (its replay buffer)."""
        if self.replay_endpoint:
            await self._replay(0)

    async def _restarted(self, why: str) -> None:
        logger.info(
            "engine %s rank %d: %s; dropping its blocks and replaying",
            self.spec.engine_id,
            self.rank,
            why,
        )
        self.counts["incarnations"] += 1
        self._reset()
        # Reported before the replay: its batches are visible (ScoreEngines) as
        # each is applied, and a reader seeing them must see the restart too.
        self._report()
        if self.replay_endpoint:
            await self._replay(0)
        self._report()

    def _reset(self) -> None:
        self.engines.index.reset_stream(self.spec.engine_id, self.rank)
        self.last = -1

    async def _live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._malformed(f"a frame of {len(frames)} parts, expected 3")
            return
        try:
            seq = decode_seq(frames[1])
        except EventFormatError as exc:
            self._malformed(str(exc))
            return
        if self.last >= 0 and seq <= self.last:
            if self._replayed.get(seq) == hash(frames[2]):
                return  # already applied from the replay
            await self._restarted(f"seq went back from {self.last} to {seq}")
        if seq > self.last + 1:
            await self._gap(seq)
        if seq == self.last + 1 or self.last < 0:
            await self._apply(seq, frames[2])
        self._report()

    async def _gap(self, seq: int) -> None:
        """Batches ``last+1 .. seq-1`` never came: replay them, or start over."""
        first_seen = self.last < 0
        if not first_seen:
            self.counts["gaps"] += 1
            logger.info(
                "engine %s rank %d: seq %d after %d; replaying",
                self.spec.engine_id,
                self.rank,
                seq,
                self.last,
            )
        self.engines.update(self.spec.engine_id, self.rank, synced=False, **self.counts)
        repaired = bool(self.replay_endpoint) and await self._replay(self.last + 1)
        if not repaired and not first_seen and self.last + 1 < seq:
            # What the engine dropped meanwhile is unknown: forget, learn again.
            self._reset()
        self.engines.update(self.spec.engine_id, self.rank, synced=True)

    async def _replay(self, start: int) -> bool:
        """Apply the engine's buffered batches from ``start``; True when none was missing."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        dealer.connect(self.replay_endpoint)
        whole = True
        first: int | None = None
        self._replayed = {}
        try:
            await dealer.send_multipart([b"", encode_seq(start)])
            while True:
                if not await dealer.poll(int(self.replay_timeout * 1000)):
                    logger.warning(
                        "engine %s rank %d: no replay from %s within %.1f s",
                        self.spec.engine_id,
                        self.rank,
                        self.replay_endpoint,
                        self.replay_timeout,
                    )
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    self._malformed(f"a replay frame of {len(frames)} parts, expected 4")
                    continue
                try:
                    seq = decode_seq(frames[2])
                except EventFormatError as exc:
                    self._malformed(str(exc))
                    continue
                if seq == -1:
                    break
                if first is None:
                    first = seq
                    whole = seq <= max(start, 0)
                if seq <= self.last:
                    continue
                if self.last >= 0 and seq != self.last + 1:
                    whole = False
                    self._reset()
                await self._apply(seq, frames[3])
                self._replayed[seq] = hash(frames[3])
        finally:
            dealer.close(linger=0)
        self.counts["replays"] += 1
        self._report()
        return whole

    async def _apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch, one frame of one stream per turn of the event loop.

        Frames already waiting are received without a pause; without the turn,
        a backlog (sixteen engines replaying at once) would hold every RPC back.
        """
        async with self.turn:
            self._apply_now(seq, payload)
            await asyncio.sleep(0)

    def _apply_now(self, seq: int, payload: bytes) -> None:
        self.last = seq
        try:
            batch = decode_batch(payload)
        except EventFormatError as exc:
            self._malformed(f"batch {seq}: {exc}")
            return
        self.engines.index.apply(self.spec.engine_id, self.rank, batch.events)
        self.counts["batches"] += 1

    def _malformed(self, what: str) -> None:
        self.counts["malformed"] += 1
        logger.warning("engine %s rank %d: skipped %s", self.spec.engine_id, self.rank, what)

    def _report(self) -> None:
        changes: dict[str, Any] = dict(self.counts)
        self.engines.update(self.spec.engine_id, self.rank, last_seq=self.last, **changes)
