"""vLLM KV events in, scores out, kvmesh's tiers re-published, on a real coordinator.

The engine side is vLLM 0.32's own ``ZmqEventPublisher`` (PUB socket, replay
ROUTER, seq from 0 per process) publishing ``KVEventBatch`` objects, as an
engine started with ``--kv-events-config`` does; the end-to-end tests with
vLLM servers are in tests/e2e/with_vllm/test_vllm_kv_events.py.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvmesh.api.coordinator.v1 import directory_pb2, engines_pb2
from kvmesh.common.keys import salt_with_lora
from kvmesh.coordinator.engine_client import EngineClient
from kvmesh.coordinator.enginefeed.subscriber import StreamFollower
from tests.integration.coordinator.conftest import CoordFactory
from tests.integration.coordinator.support import (
    L1,
    L2,
    MODEL,
    Coord,
    batch,
    code_of,
    entry,
    field_of,
    hkey,
    token_hashes,
)
from tests.support.ports import free_port
from tests.support.waiting import wait_until
from tests.support.zmqproxy import DroppingProxy

CHUNK = 64
BLOCK = 16
SCORE_DEADLINE_S = 10.0  # its own 1 s (a router's) ran out on a loaded CI host


def _prompt(n_chunks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n_chunks * CHUNK)]


def _stored(tokens: list[int], tag: str, *, salt: str = "") -> BlockStored:
    """One BlockStored of every block of ``tokens`` (hashes unique per prefix and tag)."""
    n = len(tokens) // BLOCK
    hashes = [hash((tag, tuple(tokens[: (i + 1) * BLOCK]))) & (2**63 - 1) for i in range(n)]
    extra: list[tuple[Any, ...] | None] = [None] * n
    if salt:
        extra[0] = (salt,)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(tokens),
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=extra,
    )


class Engine:
    """vLLM's publisher on free ports, and what it was asked to publish."""

    def __init__(self, port: int | None = None, replay_port: int | None = None) -> None:
        self.port = port or free_port()
        self.replay_port = replay_port or free_port()
        self.publisher = ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{self.port}",
            replay_endpoint=f"tcp://*:{self.replay_port}",
        )

    def publish(self, *events: Any) -> None:
        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def close(self) -> None:
        self.publisher.shutdown()

    def spec(self, engine_id: str, *, node: str = "", via: int | None = None) -> dict[str, Any]:
        return {
            "engine_id": engine_id,
            "endpoint": f"tcp://127.0.0.1:{via or self.port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "model_name": MODEL,
            "instance_id": node,
        }


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()


def _engine(started: list[Engine], **ports: int) -> Engine:
    engine = Engine(**ports)
    started.append(engine)
    return engine


def _try_engine(started: list[Engine], port: int, replay_port: int) -> Engine | None:
    try:
        return _engine(started, port=port, replay_port=replay_port)
    except zmq.ZMQError:
        return None


def _client(coord: Coord) -> EngineClient:
    return EngineClient(coord.target, channel=coord.clients.channel)


def _register(coord: Coord, **spec: Any) -> None:
    request = engines_pb2.RegisterEngineRequest(spec=engines_pb2.EngineSpec(**spec))
    _client(coord).register_engine(request)


def _score(coord: Coord, tokens: list[int], **fields: Any) -> dict[str, directory_pb2.EngineScore]:
    request = directory_pb2.ScoreEnginesRequest(model_name=MODEL, token_ids=tokens, **fields)
    response = coord.clients.directory.score_engines(request, timeout=SCORE_DEADLINE_S)
    return {s.engine_id: s for s in response.scores}


def _stream(coord: Coord, engine_id: str) -> engines_pb2.EngineStream:
    listing = _client(coord).list_engines(engines_pb2.ListEnginesRequest())
    status = next(e for e in listing.engines if e.spec.engine_id == engine_id)
    return status.streams[0]


def _engine_tokens(coord: Coord, tokens: list[int], engine_id: str) -> int:
    return _score(coord, tokens)[engine_id].engine_tokens


def test_engines_blocks_become_scores_per_engine(
    make_coord: CoordFactory, engines: list[Engine]
) -> None:
    a, b = _engine(engines), _engine(engines)
    # One engine named at start (the flag), one registered by RPC.
    spec_a = a.spec("engine-a")
    coord = make_coord(
        chunk_size=CHUNK,
        engine_events=f"engine-a={spec_a['endpoint']},replay={spec_a['replay_endpoint']},"
        f"model={MODEL}",
    )
    _register(coord, **b.spec("engine-b"))
    shared = _prompt(3, seed=1)
    only_b = shared[: 2 * CHUNK] + _prompt(2, seed=2)
    wait_until(lambda: _stream(coord, "engine-b").replays >= 1)
    a.publish(_stored(shared, "a"))
    b.publish(_stored(only_b, "b"))
    wait_until(lambda: _engine_tokens(coord, shared, "engine-a") == 3 * CHUNK)
    wait_until(lambda: _engine_tokens(coord, only_b, "engine-b") == 4 * CHUNK)
    scores = _score(coord, only_b)
    # engine-b holds all four chunks, engine-a the two shared ones: b first.
    assert list(scores) == ["engine-b", "engine-a"]
    assert scores["engine-a"].prefix_tokens == 2 * CHUNK
    assert scores["engine-b"].score == pytest.approx(4 * CHUNK * 1.0)
    # Named candidates only, and an unknown one.
    only = _score(coord, shared, engine_ids=["engine-b", "nobody"])
    assert set(only) == {"engine-b", "nobody"}
    assert not only["nobody"].known
    assert only["engine-b"].prefix_tokens == 2 * CHUNK
    # A partial last chunk never counts; the chunk hashes form gives the same answer.
    assert _engine_tokens(coord, shared + [5] * 10, "engine-a") == 3 * CHUNK
    by_hash = coord.clients.directory.score_engines(
        directory_pb2.ScoreEnginesRequest(
            model_name=MODEL, chunk_hashes=token_hashes(shared, CHUNK), engine_ids=["engine-a"]
        ),
        timeout=SCORE_DEADLINE_S,
    )
    assert by_hash.scores[0].engine_tokens == 3 * CHUNK
    assert by_hash.chunks == 3


def test_kvmesh_tiers_complete_the_prefix_and_weights_apply(
    make_coord: CoordFactory, engines: list[Engine]
) -> None:
    a = _engine(engines)
    coord = make_coord(chunk_size=CHUNK)
    _register(coord, **a.spec("engine-a", node="node-a"))
    # engine-b: a stream nobody publishes on.
    _register(
        coord,
        engine_id="engine-b",
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        model_name=MODEL,
        instance_id="node-b",
    )
    tokens = _prompt(4, seed=3)
    hashes = token_hashes(tokens, CHUNK)
    wait_until(lambda: _stream(coord, "engine-a").replays >= 1)
    a.publish(_stored(tokens[:CHUNK], "a"))
    # Chunk 1 in node-a's L1, chunk 2 in L2, chunk 3 nowhere.
    coord.clients.ingest_batches(
        batch("node-a", 1, tier=L1, entries=[entry(hkey(hashes[1]))]),
        batch("node-a", 2, tier=L2, entries=[entry(hkey(hashes[2]))]),
    )
    wait_until(lambda: _engine_tokens(coord, tokens, "engine-a") == CHUNK)
    scores = _score(coord, tokens)
    a_score, b_score = scores["engine-a"], scores["engine-b"]
    assert (a_score.engine_tokens, a_score.local_l1_tokens, a_score.l2_tokens) == (
        CHUNK,
        CHUNK,
        CHUNK,
    )
    assert a_score.score == pytest.approx(CHUNK * (1.0 + 0.8 + 0.4))
    # engine-b holds nothing itself; its walk stops at chunk 0.
    assert b_score.prefix_tokens == 0
    weighted = _score(coord, tokens, weights=directory_pb2.TierWeights(engine=0.0, local_l1=2.0))[
        "engine-a"
    ]
    assert weighted.score == pytest.approx(CHUNK * (0.0 + 2.0 + 0.4))


def test_salt_and_lora_must_match(make_coord: CoordFactory, engines: list[Engine]) -> None:
    a = _engine(engines)
    coord = make_coord(chunk_size=CHUNK)
    _register(coord, **a.spec("engine-a"))
    tokens = _prompt(2, seed=4)
    wait_until(lambda: _stream(coord, "engine-a").replays >= 1)
    a.publish(_stored(tokens, "a", salt="tenant-1"))
    wait_until(lambda: _score(coord, tokens, cache_salt="tenant-1")["engine-a"].engine_tokens)
    assert _engine_tokens(coord, tokens, "engine-a") == 0
    assert _score(coord, tokens, cache_salt="tenant-2")["engine-a"].engine_tokens == 0
    assert salt_with_lora("tenant-1", "", 0) == "tenant-1"


def test_a_restarted_engine_is_a_new_incarnation(
    make_coord: CoordFactory, engines: list[Engine]
) -> None:
    a = _engine(engines)
    coord = make_coord(chunk_size=CHUNK)
    _register(coord, **a.spec("engine-a"))
    old, new = _prompt(2, seed=5), _prompt(2, seed=6)
    wait_until(lambda: _stream(coord, "engine-a").replays >= 1)
    for _ in range(3):
        a.publish(_stored(old, "old"))
    wait_until(lambda: _engine_tokens(coord, old, "engine-a") == 2 * CHUNK)
    a.close()
    engines.remove(a)
    # The same ports, a new process: seq starts at 0 again. (ZMQ closes the old
    # listening sockets in its I/O thread: bind again until they are free.)
    b = wait_until(lambda: _try_engine(engines, a.port, a.replay_port))
    b.publish(_stored(new, "new"))
    wait_until(lambda: _engine_tokens(coord, new, "engine-a") == 2 * CHUNK)
    assert _engine_tokens(coord, old, "engine-a") == 0
    # A batch applied from the replay is visible before the stream's progress is
    # reported (at the replay's end): wait for that report.
    stream = wait_until(lambda: (s := _stream(coord, "engine-a")).last_seq == 0 and s)
    assert stream.incarnations >= 1
    assert stream.synced


def test_a_gap_is_repaired_from_the_replay_socket(
    make_coord: CoordFactory, engines: list[Engine]
) -> None:
    a = _engine(engines)
    proxy = DroppingProxy(f"tcp://127.0.0.1:{a.port}", drop={1})
    try:
        coord = make_coord(chunk_size=CHUNK)
        _register(coord, **a.spec("engine-a", via=proxy.port))
        wait_until(lambda: _stream(coord, "engine-a").replays >= 1)
        wait_until(proxy.connected)
        prompts = [_prompt(1, seed=10 + i) for i in range(3)]
        for i, tokens in enumerate(prompts):
            a.publish(_stored(tokens, f"p{i}"))
        # seq 1 never reaches the coordinator live; seq 2 reveals the gap.
        wait_until(lambda: all(_engine_tokens(coord, t, "engine-a") == CHUNK for t in prompts))
        stream = _stream(coord, "engine-a")
        assert stream.gaps == 1
        assert stream.replays >= 2
        assert stream.last_seq == 2
        assert proxy.dropped == [1]
        assert stream.chunks == 3
        assert stream.synced
    finally:
        proxy.close()


def test_all_blocks_cleared_and_malformed_frames(
    make_coord: CoordFactory, engines: list[Engine]
) -> None:
    port = free_port()
    coord = make_coord(chunk_size=CHUNK)
    _register(coord, engine_id="raw", endpoint=f"tcp://127.0.0.1:{port}", model_name=MODEL)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    encoder = msgspec.msgpack.Encoder()
    tokens = _prompt(2, seed=7)
    try:

        def send(seq: int, payload: bytes, parts: int = 3) -> None:
            frames = [b"", seq.to_bytes(8, "big"), payload][:parts]
            pub.send_multipart(frames)

        batch0 = encoder.encode(KVEventBatch(ts=1.0, events=[_stored(tokens, "r")]))
        wait_until(lambda: (send(0, batch0), _engine_tokens(coord, tokens, "raw"))[1])
        send(1, b"\xc1 not msgpack")
        send(2, b"", parts=2)
        send(3, encoder.encode(KVEventBatch(ts=2.0, events=[AllBlocksCleared()])))
        wait_until(lambda: _engine_tokens(coord, tokens, "raw") == 0)
        stream = _stream(coord, "raw")
        assert stream.malformed == 2
        assert stream.blocks == 0
    finally:
        pub.close(linger=0)
        ctx.term()


def test_bad_requests_get_invalid_argument(make_coord: CoordFactory) -> None:
    coord = make_coord(chunk_size=CHUNK)
    client = _client(coord)
    bad_specs = [
        ({"engine_id": "", "endpoint": "tcp://h:1", "model_name": MODEL}, "engine_id"),
        ({"engine_id": "e", "endpoint": "http://h:1", "model_name": MODEL}, "endpoint"),
        ({"engine_id": "e", "endpoint": "tcp://h:1", "model_name": ""}, "model_name"),
        (
            {
                "engine_id": "e",
                "endpoint": "tcp://h:1",
                "model_name": MODEL,
                "replay_endpoint": "x",
            },
            "replay_endpoint",
        ),
        (
            {
                "engine_id": "e",
                "endpoint": "tcp://h:1",
                "model_name": MODEL,
                "data_parallel_size": 65,
            },
            "data_parallel_size",
        ),
    ]
    for spec, field in bad_specs:
        with pytest.raises(grpc.RpcError) as err:
            client.register_engine(
                engines_pb2.RegisterEngineRequest(spec=engines_pb2.EngineSpec(**spec))
            )
        assert code_of(err.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert field_of(err.value) == field
    with pytest.raises(grpc.RpcError) as err:
        client.register_engine(engines_pb2.RegisterEngineRequest())
    assert code_of(err.value) == grpc.StatusCode.INVALID_ARGUMENT
    directory = coord.clients.directory
    bad_scores = [
        ({"model_name": MODEL}, "token_ids"),
        ({"model_name": MODEL, "token_ids": [1], "chunk_hashes": [b"x" * 32]}, "token_ids"),
        ({"model_name": MODEL, "chunk_hashes": [b"short"]}, "chunk_hashes"),
        ({"model_name": "", "token_ids": [1]}, "model_name"),
        ({"model_name": MODEL, "token_ids": [1], "engine_ids": [""]}, "engine_ids"),
        ({"model_name": MODEL, "token_ids": [1], "world_size": 300}, "world_size"),
        (
            {"model_name": MODEL, "token_ids": [1], "weights": directory_pb2.TierWeights(l2=-1)},
            "l2",
        ),
    ]
    for fields, field in bad_scores:
        with pytest.raises(grpc.RpcError) as err:
            directory.score_engines(
                directory_pb2.ScoreEnginesRequest(**fields), timeout=SCORE_DEADLINE_S
            )
        assert code_of(err.value) == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert field_of(err.value) == field, fields
    assert not client.deregister_engine(engines_pb2.DeregisterEngineRequest(engine_id="e")).existed


def test_kvmesh_tiers_are_republished_as_vllm_events(make_coord: CoordFactory) -> None:
    port, replay = free_port(), free_port()
    coord = make_coord(
        chunk_size=CHUNK,
        publish_events_endpoint=f"tcp://127.0.0.1:{port}",
        publish_events_replay_endpoint=f"tcp://127.0.0.1:{replay}",
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvmesh@node-a@")
    sub.connect(f"tcp://127.0.0.1:{port}")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    tokens = _prompt(2, seed=8)
    hashes = token_hashes(tokens, CHUNK)
    try:
        time.sleep(0.3)  # a SUB socket misses what is sent before it is connected
        coord.clients.ingest_batches(
            batch(
                "node-a",
                1,
                entries=[
                    entry(hkey(h), tokens=tokens[i * CHUNK : (i + 1) * CHUNK], offset=i * CHUNK)
                    for i, h in enumerate(hashes)
                ],
            )
        )
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == f"kvmesh@node-a@{MODEL}".encode()
        assert int.from_bytes(seq, "big") == 0
        # vLLM's own decoder reads it.
        events = decoder.decode(payload).events
        assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored"]
        first, second = events
        assert first.medium == "KVMESH_L1"
        assert first.block_size == CHUNK
        assert first.token_ids == tokens[:CHUNK]
        assert first.parent_block_hash is None
        assert second.parent_block_hash == first.block_hashes[0]
        assert first.block_hashes == [int.from_bytes(hashes[0][:8], "big")]
        # The replay socket answers vLLM's protocol.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(5000)
        replayed = dealer.recv_multipart()
        assert replayed[1:3] == [topic, seq]
        assert replayed[3] == payload
        assert dealer.poll(5000)
        assert dealer.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)
        dealer.close(linger=0)
        # A node's restart (new incarnation fences its L1) clears its topics.
        coord.clients.ingest_batches(batch("node-a", 1, incarnation=2))
        assert sub.poll(5000)
        cleared = decoder.decode(sub.recv_multipart()[2]).events
        assert [type(e).__name__ for e in cleared] == ["AllBlocksCleared"]
    finally:
        sub.close(linger=0)
        ctx.term()


def test_a_follower_that_fails_starts_over_and_relearns_from_the_replay(
    make_coord: CoordFactory, engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    failures: list[int] = []
    live = StreamFollower._live

    async def fail_once(self: StreamFollower, frames: list[bytes]) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("a bug in a follower")
        await live(self, frames)

    monkeypatch.setattr(StreamFollower, "_live", fail_once)
    a = _engine(engines)
    coord = make_coord(chunk_size=CHUNK)
    _register(coord, **a.spec("engine-a"))
    tokens = _prompt(2, seed=9)
    wait_until(lambda: _stream(coord, "engine-a").replays >= 1)
    a.publish(_stored(tokens, "a"))
    # The first live frame kills the follower; the new one replays it from vLLM's buffer.
    wait_until(lambda: _engine_tokens(coord, tokens, "engine-a") == 2 * CHUNK, 15)
    assert failures == [1]


def test_a_restart_is_reported_before_its_replay_ends(
    make_coord: CoordFactory, engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader who sees the new incarnation's blocks also sees the restart counted."""
    gate = threading.Event()
    apply = StreamFollower._apply

    async def held_after_a_restart(self: StreamFollower, seq: int, payload: bytes) -> None:
        await apply(self, seq, payload)
        if self.counts["batches"] > 1 and not gate.is_set():
            await asyncio.to_thread(gate.wait, 30)  # the replay, paused mid-way

    a = _engine(engines)
    coord = make_coord(chunk_size=CHUNK)
    _register(coord, **a.spec("engine-a"))
    old, new = _prompt(2, seed=11), _prompt(2, seed=12)
    wait_until(lambda: _stream(coord, "engine-a").replays >= 1)
    a.publish(_stored(old, "old"))
    wait_until(lambda: _engine_tokens(coord, old, "engine-a") == 2 * CHUNK)
    monkeypatch.setattr(StreamFollower, "_apply", held_after_a_restart)
    a.close()
    engines.remove(a)
    b = wait_until(lambda: _try_engine(engines, a.port, a.replay_port))
    b.publish(_stored(new, "new"))
    try:
        wait_until(lambda: _engine_tokens(coord, new, "engine-a") == 2 * CHUNK)
        assert _stream(coord, "engine-a").incarnations >= 1
    finally:
        gate.set()
    wait_until(lambda: _stream(coord, "engine-a").replays >= 2)
    assert _engine_tokens(coord, old, "engine-a") == 0
