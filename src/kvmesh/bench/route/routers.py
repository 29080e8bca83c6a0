"""The routers the benchmark compares: which engine serves a prompt.

- :class:`ScoreRouter` asks the coordinator's
  ``DirectoryService/ScoreEngines`` and sends the prompt to the best-scored
  engine;
- :class:`RoundRobinRouter` cycles through the engines;
- :class:`OracleRouter` knows every engine's cache exactly: it keeps the
  prompts it sent to each engine and picks the one sharing the longest
  prefix, in whole chunks.

Ties (equal values, e.g. nothing cached anywhere) go to the engine with the
fewest requests in flight, then round robin. The request threads of
:func:`kvmesh.bench.serve.client.run_round` call :meth:`Router.pick` before
sending and :meth:`Router.done` after the answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kvmesh.api.coordinator.v1 import directory_pb2, directory_pb2_grpc
from kvmesh.bench.common import LoopThread, percentile
from kvmesh.common.hashing import TokenHasher

#: Deadline of one ScoreEngines call.
SCORE_TIMEOUT_S = 5.0


class Router:
    """Picks an engine (an index into the fleet's engines) for each prompt."""

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self._lock = threading.Lock()
        self._in_flight = [0] * engines
        self._next = 0  # where the round robin of ties starts

    def rank(self, prompt: Sequence[int]) -> Sequence[float]:
        """A value per engine for ``prompt``, higher is better (called outside the lock)."""
        raise NotImplementedError

    def record(self, engine: int, prompt: Sequence[int]) -> None:
        """``prompt`` goes to ``engine`` (called with the lock held)."""

    def pick(self, prompt: Sequence[int]) -> int:
        """The engine to send ``prompt`` to, now counted in flight there."""
        values = self.rank(prompt)
        with self._lock:
            best = max(values)
            tied = [i for i, v in enumerate(values) if v == best]
            fewest = min(self._in_flight[i] for i in tied)
            tied = [i for i in tied if self._in_flight[i] == fewest]
            chosen = min(tied, key=lambda i: (i - self._next) % self.engines)
            self._next = (chosen + 1) % self.engines
            self._in_flight[chosen] += 1
            self.record(chosen, prompt)
        return chosen

    def done(self, engine: int) -> None:
        """The request sent to ``engine`` was answered (or failed)."""
        with self._lock:
            self._in_flight[engine] -= 1

    def figures(self) -> dict[str, Any]:
        """The router's own figures for the report (none by default)."""
        return {}

    def close(self) -> None:
        """Release what the router holds (nothing by default)."""


class RoundRobinRouter(Router):
    """The next engine in turn, whatever the prompt and the load."""

    def pick(self, prompt: Sequence[int]) -> int:
        with self._lock:
            chosen = self._next
            self._next = (chosen + 1) % self.engines
            self._in_flight[chosen] += 1
        return chosen


class OracleRouter(Router):
    """The engine that was sent the longest prefix of the prompt, in whole chunks.

    Each engine's cache is modelled as every prompt sent there (nothing
    evicted, nothing shared between engines), which is how the benchmark
    sizes the fleet.
    """

    def __init__(self, engines: int, chunk_size: int) -> None:
        super().__init__(engines)
        self._hasher = TokenHasher(chunk_size)
        self._chunk_size = chunk_size
        # Per engine: the chained hash of every chunk prefix sent there.
        self._seen: list[set[bytes]] = [set() for _ in range(engines)]

    def rank(self, prompt: Sequence[int]) -> Sequence[float]:
        hashes = self._hasher.hash_chunks(prompt)
        values = []
        for seen in self._seen:
            matched = 0
            while matched < len(hashes) and hashes[matched] in seen:
                matched += 1
            values.append(float(matched * self._chunk_size))
        return values

    def record(self, engine: int, prompt: Sequence[int]) -> None:
        self._seen[engine].update(self._hasher.hash_chunks(prompt))


class ScoreRouter(Router):
    """The engine the coordinator scores best for the prompt (``ScoreEngines``).

    One grpc.aio channel to the coordinator stays open on a loop thread of
    its own; each call is timed from the request to the answer. A call that
    fails counts in ``score_failed`` and leaves every engine tied.
    """

    def __init__(self, engine_ids: Sequence[str], coordinator: str, model_name: str) -> None:
        super().__init__(len(engine_ids))
        self._engine_ids = list(engine_ids)
        self._model_name = model_name
        self._loop = LoopThread("kvmesh-bench-route-score")
        self._channel = self._loop.run(self._open(coordinator))
        self._stub = directory_pb2_grpc.DirectoryServiceStub(self._channel)
        self._latencies: list[float] = []
        self._failed = 0
        self._informed = 0  # answers where some engine scored above 0

    @staticmethod
    async def _open(target: str) -> grpc.aio.Channel:
        # A grpc.aio channel belongs to the loop it is made on.
        return grpc.aio.insecure_channel(target)

    async def _score(
        self, request: directory_pb2.ScoreEnginesRequest
    ) -> tuple[directory_pb2.ScoreEnginesResponse, float]:
        start = time.perf_counter()
        response = await self._stub.ScoreEngines(request, timeout=SCORE_TIMEOUT_S)
        return response, time.perf_counter() - start

    def scores(self, prompt: Sequence[int]) -> directory_pb2.ScoreEnginesResponse:
        """The coordinator's answer for ``prompt`` over the fleet's engines (untimed)."""
        request = self._request(prompt)
        response, _ = self._loop.run(self._score(request), SCORE_TIMEOUT_S + 5)
        return response

    def _request(self, prompt: Sequence[int]) -> directory_pb2.ScoreEnginesRequest:
        return directory_pb2.ScoreEnginesRequest(
            model_name=self._model_name, token_ids=prompt, engine_ids=self._engine_ids
        )

    def rank(self, prompt: Sequence[int]) -> Sequence[float]:
        try:
            response, seconds = self._loop.run(
                self._score(self._request(prompt)), SCORE_TIMEOUT_S + 5
            )
        except grpc.aio.AioRpcError:
            with self._lock:
                self._failed += 1
            return [0.0] * self.engines
        by_id = {s.engine_id: s.score for s in response.scores}
        values = [by_id.get(engine_id, 0.0) for engine_id in self._engine_ids]
        with self._lock:
            self._latencies.append(seconds)
            if max(values) > 0:
                self._informed += 1
        return values

    def figures(self) -> dict[str, Any]:
        latencies = sorted(1e3 * s for s in self._latencies)
        return {
            "score_calls": len(latencies) + self._failed,
            "score_failed": self._failed,
            "score_informed": self._informed,
            "score_p50_ms": round(percentile(latencies, 0.5), 3) if latencies else None,
            "score_p99_ms": round(percentile(latencies, 0.99), 3) if latencies else None,
        }

    def close(self) -> None:
        try:
            self._loop.run(self._channel.close(), 10)
        finally:
            self._loop.close()
