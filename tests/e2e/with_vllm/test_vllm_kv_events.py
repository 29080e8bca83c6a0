"""Real vLLM publishing its KV events to the coordinator, with kvmesh beside it.

One ``kvmesh coordinator`` following one vLLM OpenAI server (its KV events
reach the coordinator through a forwarder that can lose frames, like a
dropped stream), one ``kvmesh node`` reporting to the coordinator, and a
plain ZMQ subscriber on the coordinator's re-published events:

1. a prompt's chunks show up in ScoreEngines as the engine's own, and the
   node's L1 copies come out of the coordinator as vLLM ``BlockStored``
   events (medium ``KVMESH_L1``) a plain subscriber decodes;
2. a lost frame is a gap, repaired from vLLM's replay socket: the directory
   ends equal to what the engine holds;
3. ``/reset_prefix_cache`` (vLLM's ``AllBlocksCleared``) empties the
   engine's tier while kvmesh's L1 still scores;
4. vLLM killed and started again on the same endpoints: its seq restarts
   at 0, the old incarnation's blocks are gone, and the new one's are learned.

vLLM's event sockets are unix sockets (``ipc://``): a TCP port picked ahead
could be taken by another process in the half minute before vLLM binds it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import KVEventBatch

from kvmesh.api.coordinator.v1 import directory_pb2, engines_pb2
from kvmesh.common.hashing import TokenHasher
from kvmesh.coordinator.client import DirectoryClient
from kvmesh.coordinator.engine_client import EngineClient
from kvmesh.engine.vllm.worker import engine_env, transfer_config
from tests.e2e.with_vllm.support import healthy
from tests.support.harness import REPO_ROOT
from tests.support.ports import free_port
from tests.support.waiting import wait_until
from tests.support.zmqproxy import DroppingProxy

pytestmark = pytest.mark.slow

CHUNK = 256
PROMPT = 3 * CHUNK + 40
ENGINE = "vllm-a"


class Fleet:
    """The coordinator, the node, vLLM and the forwarder, on this test's own ports."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp = tmp
        self.model = str(model)
        self.events = f"ipc://{tmp}/vllm-events.sock"
        self.replay = f"ipc://{tmp}/vllm-replay.sock"
        self.proxy = DroppingProxy(self.events)
        self.coord_port, self.node_port, self.http = free_port(), free_port(), free_port()
        self.published = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        engines = (
            f"{ENGINE}=tcp://127.0.0.1:{self.proxy.port},replay={self.replay},"
            f"model={self.model},node=node-a"
        )
        coordinator = [
            "coordinator", "--port", str(self.coord_port), "--metrics-port", "-1",
            "--engine-events", engines,
            "--publish-events-endpoint", f"tcp://127.0.0.1:{self.published}",
        ]  # fmt: skip
        self._start("coordinator", coordinator)
        self.directory = DirectoryClient(f"127.0.0.1:{self.coord_port}")
        self.engines = EngineClient(f"127.0.0.1:{self.coord_port}")
        wait_until(self._coordinator_up, 60)
        node = [
            "node", "--host", "127.0.0.1", "--port", str(self.node_port),
            "--metrics-port", "-1", "--l1-size-bytes", "256MiB", "--l2", "none",
            "--instance-id", "node-a", "--coordinator-target", f"127.0.0.1:{self.coord_port}",
            "--shm-dir", str(tmp / "l1"), "--data-dir", str(tmp / "node"),
        ]  # fmt: skip
        (tmp / "l1").mkdir(exist_ok=True)
        self._start("node", node)

    def _coordinator_up(self) -> bool:
        try:
            self.engines.list_engines(engines_pb2.ListEnginesRequest(), timeout=1.0)
            return True
        except Exception:
            return False

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        argv = args if args[0] == sys.executable else [sys.executable, "-m", "kvmesh.cli", *args]
        with (self.tmp / f"{name}.log").open("a") as out:
            self.procs[name] = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                env=env or dict(os.environ),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_vllm(self) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
        }
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--port", str(self.http), "--host", "127.0.0.1", "--enforce-eager",
            "--max-model-len", "4096", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(transfer_config(f"127.0.0.1:{self.node_port}")),
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        env = {**os.environ, **engine_env(1), "VLLM_SERVER_DEV_MODE": "1"}
        self._start("vllm", command, env)
        vllm = self.procs["vllm"]
        wait_until(lambda: healthy(self.base) or vllm.poll() is not None, 300)
        assert vllm.poll() is None, self.log("vllm")

    def kill_vllm(self) -> None:
        vllm = self.procs.pop("vllm")
        os.killpg(vllm.pid, signal.SIGKILL)
        vllm.wait(60)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        return _post(f"{self.base}/v1/completions", body)

    def score(self, prompt: list[int]) -> directory_pb2.EngineScore:
        response = self.directory.score_engines(
            directory_pb2.ScoreEnginesRequest(model_name=self.model, token_ids=prompt),
            timeout=10.0,
        )
        return next(s for s in response.scores if s.engine_id == ENGINE)

    def stream(self) -> engines_pb2.EngineStream:
        listing = self.engines.list_engines(engines_pb2.ListEnginesRequest())
        return listing.engines[0].streams[0]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.directory.close()
        self.engines.close()
        self.proxy.close()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200
        text = resp.read()
    return json.loads(text) if text else {}


@pytest.fixture
def fleet(tmp_path: Path, tiny_model: Path) -> Iterator[Fleet]:
    started = Fleet(tmp_path, tiny_model)
    try:
        yield started
    finally:
        started.close()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(PROMPT)] for _ in range(n)]


def test_vllm_kv_events_feed_scores_through_gaps_clears_and_restarts(fleet: Fleet) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvmesh@node-a@")
    sub.connect(f"tcp://127.0.0.1:{fleet.published}")
    try:
        fleet.start_vllm()
        wait_until(fleet.proxy.connected, 30)
        first, lost, after, later = _prompts(4, seed=31)
        full = PROMPT // CHUNK * CHUNK

        # 1. The engine's own blocks, as kvmesh chunks.
        fleet.complete(first)
        wait_until(lambda: fleet.score(first).engine_tokens == full, 30)
        # The node's L1 copies, re-published as vLLM events.
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        expected = {int.from_bytes(h[:8], "big") for h in TokenHasher(CHUNK).hash_chunks(first)}
        seen: set[int] = set()
        while not expected <= seen:
            assert sub.poll(30_000), f"re-published: {seen}, expected {expected}"
            topic, _, payload = sub.recv_multipart()
            assert topic == f"kvmesh@node-a@{fleet.model}".encode()
            for event in decoder.decode(payload).events:
                assert type(event).__name__ == "BlockStored"
                assert event.medium == "KVMESH_L1"
                seen.update(event.block_hashes)

        # 2. A lost frame: the gap is replayed from vLLM's buffer.
        fleet.proxy.drop_next = 1
        fleet.complete(lost)
        wait_until(lambda: fleet.proxy.dropped, 30)
        fleet.complete(after)
        wait_until(lambda: fleet.score(after).engine_tokens == full, 30)
        assert fleet.score(lost).engine_tokens == full
        # The replay's batches score as each is applied; the stream is synced once it ends.
        wait_until(lambda: fleet.stream().synced, 30)
        stream = fleet.stream()
        assert stream.gaps == 1
        assert stream.synced
        assert stream.chunks == 3 * (PROMPT // CHUNK)

        # 3. vLLM's prefix cache reset: AllBlocksCleared; kvmesh's L1 still holds them.
        # (vLLM refuses while a block is held, e.g. by a store still in flight.)
        wait_until(lambda: _post(f"{fleet.base}/reset_prefix_cache", {})["success"], 30)
        # vLLM publishes a step's events with the next step.
        fleet.complete(later)
        wait_until(lambda: fleet.score(later).engine_tokens == full, 30)
        assert fleet.score(first).engine_tokens == 0
        assert fleet.score(first).local_l1_tokens == full
        assert fleet.stream().chunks == PROMPT // CHUNK

        # 4. vLLM restarted on the same endpoints: a new incarnation.
        fleet.kill_vllm()
        fleet.start_vllm()
        # The new process's first batch (seq 0 again) tells the restart.
        fleet.complete(first)
        wait_until(lambda: fleet.score(first).engine_tokens == full, 60)
        assert fleet.stream().incarnations >= 1
        assert fleet.score(later).engine_tokens == 0
        wait_until(lambda: fleet.stream().synced, 30)
        stream = fleet.stream()
        assert stream.chunks == PROMPT // CHUNK
        assert stream.synced
    except BaseException:
        for name in ("coordinator", "node", "vllm"):
            if (fleet.tmp / f"{name}.log").exists():
                print(f"--- {name}.log\n{fleet.log(name)}")
        raise
    finally:
        sub.close(linger=0)
        ctx.term()
