"""Engines for the score benchmark: ZMQ PUB sockets publishing vLLM-format KV events.

(Or, for the in-process timing of the scoring itself, the same batches handed
to a sink that applies them to a coordinator core in this process.)

Each engine's blocks form prompt chains (parent hash = the previous block);
:meth:`EngineFeeds.store_prompt` publishes a whole prompt, and the feeder
thread (:meth:`EngineFeeds.start_feeding`) keeps each engine growing new
chains block by block and dropping old ones, as a serving engine's steps do.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq

from kvmesh.bench.common import free_port
from kvmesh.coordinator.core.engineevents import (
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
    encode_batch,
    encode_seq,
)

#: Chains a feeding engine keeps before it removes its oldest.
LIVE_CHAINS = 64


#: Where an engine's batches go instead of a socket: ``sink(engine_id, events)``.
Sink = Callable[[str, tuple[EngineEvent, ...]], None]


class _Engine:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]] | None,
        index: int,
        block_size: int,
        sink: Sink | None,
    ) -> None:
        self.port = 0
        self.sock: zmq.Socket[bytes] | None = None
        if ctx is not None:
            self.port = free_port()
            self.sock = ctx.socket(zmq.PUB)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.SNDHWM, 1_000_000)
            self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.sink = sink
        self.engine_id = f"engine-{index:02d}"
        self.block_size = block_size
        self.seq = 0
        self.hashes = itertools.count(index << 40)
        self.chains: deque[list[int]] = deque()
        self.growing: list[int] = []
        self.sent = 0

    def publish(self, *events: EngineEvent) -> None:
        if self.sink is not None:
            self.sink(self.engine_id, events)
        else:
            assert self.sock is not None
            payload = encode_batch(EventBatch(time.time(), events, 0))
            self.sock.send_multipart([b"", encode_seq(self.seq), payload])
        self.seq += 1
        self.sent += 1

    def stored(self, tokens: list[int], parent: int | None) -> tuple[BlockStored, list[int]]:
        n = len(tokens) // self.block_size
        hashes = [next(self.hashes) for _ in range(n)]
        event = BlockStored(
            tuple(hashes), parent, tuple(tokens[: n * self.block_size]), self.block_size
        )
        return event, hashes


class EngineFeeds:
    """``count`` engines publishing on loopback ports (or into ``sink``), and the feeder thread."""

    def __init__(self, count: int, block_size: int, seed: int, sink: Sink | None = None) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None if sink else zmq.Context()
        self.engines = [_Engine(self._ctx, i, block_size, sink) for i in range(count)]
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def spec(self, model: str) -> list[dict[str, str]]:
        """The engines file the coordinator reads (no replay: the feed never loses frames)."""
        return [
            {"engine_id": e.engine_id, "endpoint": f"tcp://127.0.0.1:{e.port}", "model_name": model}
            for e in self.engines
        ]

    def store_prompt(self, index: int, tokens: list[int]) -> None:
        """Publish ``tokens`` as one chain of the engine's blocks, in one batch."""
        engine = self.engines[index]
        event, _ = engine.stored(tokens, None)
        engine.publish(event)

    def sent(self) -> int:
        return sum(e.sent for e in self.engines)

    def start_feeding(self, rate_per_engine: float) -> None:
        """Each engine publishes ``rate_per_engine`` batches a second until :meth:`close`."""
        self._thread = threading.Thread(
            target=self._feed, args=(rate_per_engine,), name="score-feed", daemon=True
        )
        self._thread.start()

    def step(self) -> None:
        """One scheduler step of every engine."""
        for engine in self.engines:
            self._step(engine)

    def _feed(self, rate: float) -> None:
        period = 1.0 / rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.step()
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)

    def _step(self, engine: _Engine) -> None:
        """One scheduler step: the next block of the growing chain, maybe an eviction."""
        bs = engine.block_size
        tokens = [self._rng.randrange(1, 30_000) for _ in range(bs)]
        parent = engine.growing[-1] if engine.growing else None
        event, hashes = engine.stored(tokens, parent)
        engine.growing.extend(hashes)
        events: list[EngineEvent] = [event]
        if len(engine.growing) * bs >= 2048:
            engine.chains.append(engine.growing)
            engine.growing = []
        if len(engine.chains) > LIVE_CHAINS:
            old = engine.chains.popleft()
            events.append(BlockRemoved(tuple(reversed(old))))
        engine.publish(*events)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for engine in self.engines:
            if engine.sock is not None:
                engine.sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()


class FeedProcess:
    """:class:`EngineFeeds` in a child process, so its publishing never takes this one's GIL.

    Start it before any gRPC channel exists in this process (it forks).
    """

    def __init__(self, count: int, block_size: int, seed: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve_feeds, args=(child, count, block_size, seed), daemon=True
        )
        self._proc.start()
        child.close()

    def _ask(self, *command: Any) -> Any:
        self._conn.send(command)
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"the engine feed failed: {value}")
        return value

    def spec(self, model: str) -> list[dict[str, str]]:
        return list(self._ask("spec", model))

    def store_prompt(self, index: int, tokens: list[int]) -> None:
        self._ask("store", index, tokens)

    def start_feeding(self, rate_per_engine: float) -> None:
        self._ask("feed", rate_per_engine)

    def sent(self) -> int:
        return int(self._ask("sent"))

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self._ask("close")
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()


def _serve_feeds(conn: Connection, count: int, block_size: int, seed: int) -> None:
    feeds = EngineFeeds(count, block_size, seed)
    try:
        while True:
            command, *args = conn.recv()
            try:
                if command == "close":
                    conn.send((True, None))
                    return
                handlers: dict[str, Callable[..., Any]] = {
                    "spec": feeds.spec,
                    "store": feeds.store_prompt,
                    "feed": feeds.start_feeding,
                    "sent": feeds.sent,
                }
                conn.send((True, handlers[command](*args)))
            except Exception as exc:  # reported to the parent, which raises it
                conn.send((False, repr(exc)))
    finally:
        feeds.close()
