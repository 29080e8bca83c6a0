"""Crashes and restarts with real processes (``kvmesh coordinator``, ``kvmesh storage``).

* The coordinator SIGKILLed after a checkpoint comes back on the same port
  with exactly the checkpointed directory, usage and cursors; pins and
  quotas come back from the metadata file; what was admitted after the
  checkpoint is lost, and the emitter's next batch shows it as a gap.
* A restarted emitter (new incarnation) loses its L1 placements and keeps
  its L2 ones.
* A silent node is dropped after the heartbeat timeout: unregistered, L1
  fenced, L2 kept.
* A storage node SIGKILLed in the middle of L2 write-through never serves a
  torn object after restart, rebuilds its disk index, and the coordinator
  sees the new incarnation (L1 fenced, L2 kept).
* A coordinator that is down for a while misses nothing: the node keeps
  every change meanwhile and each reaches the directory exactly once.

Every fixture kills its child processes in ``finally``, also when the test
fails.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import admin_pb2, directory_pb2, membership_pb2, policy_pb2
from kvmesh.api.storage.v1 import storage_pb2, storage_pb2_grpc
from tests.integration.coordinator.conftest import CoordFactory
from tests.integration.coordinator.support import (
    ADMITTED,
    CONFIG,
    L1,
    L2,
    Clients,
    CliProcess,
    RawNode,
    batch,
    code_of,
    eventually,
    pkey,
    stores,
)
from tests.integration.storage.support import (
    BLOCKS_PER_CHUNK,
    CHUNK_TOKENS,
    NUM_BLOCKS,
    Engine,
    chunk_blocks,
    new_hashes,
    row,
)
from tests.support.ports import free_port

MIB = 1 << 20
CHUNKS_PER_ROUND = NUM_BLOCKS // BLOCKS_PER_CHUNK

ProcessFactory = Callable[..., CliProcess]


@pytest.fixture
def processes() -> Iterator[ProcessFactory]:
    """Make ``CliProcess`` handles (not started); every one is killed at the end."""
    made: list[CliProcess] = []

    def make(service: str, *args: str, port: int | None = None) -> CliProcess:
        proc = CliProcess(service, port or free_port(), ["--log-level", "WARNING", *args])
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.kill()


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """This test's directory under /dev/shm (L1 segments, engine files)."""
    root = Path("/dev/shm") / f"kvmesh-coord-it-{uuid.uuid4().hex[:12]}"
    (root / "l1").mkdir(parents=True)
    (root / "engine").mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _coordinator_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--chunk-size",
        "4",
        "--grace-seconds",
        "0.5",
        "--checkpoint-path",
        str(tmp_path / "coordinator.ckpt"),
        "--metadata-path",
        str(tmp_path / "metadata.json"),
        "--checkpoint-interval-seconds",
        "0",
        "--eviction-check-interval-seconds",
        "0",
        *extra,
    ]


def _keys_view(c: Clients, ids: range) -> list[Any]:
    return [r.SerializeToString() for r in c.lookup(*(pkey(i) for i in ids)).results]


# ---------------------------------------------------------------------- coordinator kill


def test_sigkill_after_a_checkpoint_restores_the_checkpointed_state(
    processes: ProcessFactory, tmp_path: Path
) -> None:
    coordinator = processes(
        "coordinator", *_coordinator_args(tmp_path, "--health-check-interval-seconds", "0")
    )
    coordinator.start()
    c = Clients.connect(coordinator.target)
    node = RawNode(coordinator.target, "node-a", incarnation=1)
    node.batch(1, tier=L1, entries=stores([1, 2], salt="t"))
    node.batch(2, tier=L2, entries=stores([2, 3], size=300, salt="t"))
    node.batch(3, tier=L2, event_type=CONFIG, capacity_bytes=1 << 20, capacity_revision=1)
    assert [v[2] for v in node.verdicts(3)] == [ADMITTED] * 3
    c.ingest_batches(batch("node-b", 1, tier=L2, entries=stores([3, 4], size=50)))
    c.policy.set_quota(policy_pb2.SetQuotaRequest(cache_salt="t", tier=L2, limit_bytes=4096))
    c.policy.set_default_quota(policy_pb2.SetDefaultQuotaRequest(tier=L2, limit_bytes=1 << 30))
    c.policy.pin_keys(
        policy_pb2.PinKeysRequest(keys=directory_pb2.KeyList(keys=[pkey(3), pkey(3)]))
    )
    ids = range(1, 12)
    checkpointed = (_keys_view(c, ids), c.usage(), c.cursors(), c.stats())
    response = c.admin.checkpoint(admin_pb2.CheckpointRequest())
    assert response.size_bytes > 0
    # Admitted after the checkpoint: lost with the process.
    node.batch(4, tier=L2, entries=stores([10]))
    node.wait_acks(4)
    coordinator.kill()
    error = node.wait_ended()
    assert error is not None
    node.close()

    coordinator.start()
    status = c.admin.get_status(admin_pb2.GetStatusRequest(), wait_for_ready=True)
    assert status.restored
    assert (_keys_view(c, ids), c.usage(), c.cursors(), c.stats()) == checkpointed
    # Pins and quotas came back from the metadata document.
    pins = c.policy.list_pins(policy_pb2.ListPinsRequest())
    assert [(p.key.chunk_hash, p.pin_count) for p in pins.pins] == [(pkey(3).chunk_hash, 2)]
    quota = c.policy.get_quota(policy_pb2.GetQuotaRequest(cache_salt="t", tier=L2)).quota
    assert quota.limit_bytes == 4096
    assert c.policy.get_default_quota(policy_pb2.GetDefaultQuotaRequest()).limit_bytes == 1 << 30

    # The emitter carries on where it was; the batch lost with the process shows as a gap.
    node = RawNode(coordinator.target, "node-a", incarnation=1)
    node.batch(5, tier=L2, entries=stores([11]))
    assert node.verdicts(1) == [(1, 5, ADMITTED)]
    cursor = c.cursors()["node-a"]
    assert (cursor.last_seq, cursor.gap_detected) == (5, True)
    assert c.placements(pkey(10)) == []
    node.close()

    # A restarted emitter (new incarnation) loses its L1 placements, keeps its L2 ones.
    restarted = RawNode(coordinator.target, "node-a", incarnation=2)
    restarted.batch(1, tier=L1, entries=stores([20]))
    assert restarted.verdicts(1) == [(2, 1, ADMITTED)]
    assert c.placements(pkey(1, salt="t")) == []
    assert c.placements(pkey(2, salt="t")) == [("node-a", 1, L2, "disk", 300)]
    assert c.placements(pkey(3, salt="t")) == [("node-a", 1, L2, "disk", 300)]
    assert c.stats().l1_keys_by_instance["node-a"] == 1
    cursor = c.cursors()["node-a"]
    assert (cursor.incarnation, cursor.last_seq, cursor.gap_detected) == (2, 1, False)
    restarted.close()
    c.close()


def test_a_silent_node_is_dropped_after_the_heartbeat_timeout(
    processes: ProcessFactory, tmp_path: Path
) -> None:
    coordinator = processes(
        "coordinator",
        "--instance-timeout-seconds",
        "1",
        "--health-check-interval-seconds",
        "0.2",
        "--heartbeat-interval-seconds",
        "0.5",
        "--grace-seconds",
        "0.5",
    )
    coordinator.start()
    c = Clients.connect(coordinator.target)
    response = c.register("node-s")
    assert (response.heartbeat_interval_ms, response.instance_timeout_ms) == (500, 1000)
    c.ingest_batches(
        batch("node-s", 1, tier=L1, entries=stores([1, 2])),
        batch("node-s", 2, tier=L2, entries=stores([2, 3])),
    )
    assert list(c.instances()) == ["node-s"]
    # Never heartbeats.
    eventually(lambda: c.instances() == {}, timeout=15)
    eventually(lambda: "node-s" not in c.cursors())
    assert c.placements(pkey(1)) == []
    assert c.placements(pkey(2)) == [("node-s", 1, L2, "disk", 100)]
    assert c.placements(pkey(3)) == [("node-s", 1, L2, "disk", 100)]
    assert {(s.tier, s.used_bytes) for s in c.usage().salts} == {(L2, 200)}
    with pytest.raises(grpc.RpcError) as info:
        c.membership.heartbeat(membership_pb2.HeartbeatRequest(instance_id="node-s"))
    assert code_of(info.value) == grpc.StatusCode.NOT_FOUND
    c.close()


# ------------------------------------------------------------------------- storage nodes


class StorageNode:
    """A ``kvmesh storage`` process with a disk L2, and a blocking stub to it."""

    def __init__(self, proc: CliProcess, data_dir: Path, instance_id: str) -> None:
        self.proc = proc
        self.data_dir = data_dir
        self.instance_id = instance_id
        self.channel: grpc.Channel | None = None
        self.stub: storage_pb2_grpc.StorageServiceStub | None = None

    def start(self) -> None:
        self.proc.start()
        self.channel = grpc.insecure_channel(self.proc.target)
        self.stub = storage_pb2_grpc.StorageServiceStub(self.channel)

    def kill(self) -> None:
        self.proc.kill()
        if self.channel is not None:
            self.channel.close()

    def call(self, method: str, request: Any) -> Any:
        assert self.stub is not None
        return getattr(self.stub, method)(request, timeout=30)

    def status(self) -> storage_pb2.GetStatusResponse:
        return self.call("GetStatus", storage_pb2.GetStatusRequest())  # type: ignore[no-any-return]

    def register(self, engine: Engine) -> None:
        self.call("RegisterEngineMemory", engine.register_request())

    def store_round(self, engine: Engine, rng: np.random.Generator) -> dict[bytes, bytes]:
        """Fresh random KV in every block, stored as new chunks; hash → its bytes."""
        engine.kv[:] = rng.standard_normal(engine.kv.shape).astype(np.float16)
        hashes = new_hashes(CHUNKS_PER_ROUND)
        response = self.call(
            "StoreChunks",
            storage_pb2.StoreChunksRequest(
                engine_id=engine.engine_id,
                keys=row(hashes),
                block_ids=list(range(NUM_BLOCKS)),
                chunk_tokens=CHUNK_TOKENS,
            ),
        )
        assert len(response.outcomes) == CHUNKS_PER_ROUND
        return {h: engine.chunk(chunk_blocks(i)) for i, h in enumerate(hashes)}

    def objects(self, tier: common_pb2.Tier.ValueType) -> list[storage_pb2.StoredObject]:
        out: list[storage_pb2.StoredObject] = []
        token = ""
        while True:
            page = self.call(
                "ListObjects", storage_pb2.ListObjectsRequest(tier=tier, page_token=token)
            )
            out.extend(page.objects)
            token = page.next_page_token
            if not token:
                return out

    def placements(self) -> set[tuple[bytes, int, str, int]]:
        """What the node holds, as the directory should show it."""
        return {
            (o.key.chunk_hash, o.tier, o.backend, o.size_bytes)
            for o in self.objects(common_pb2.TIER_ALL)
        }

    def read_back(self, engine: Engine, hashes: list[bytes]) -> dict[bytes, bytes]:
        """Load ``hashes`` through the node (L2 → L1 → engine blocks); hash → bytes read."""
        out: dict[bytes, bytes] = {}
        for start in range(0, len(hashes), CHUNKS_PER_ROUND):
            group = hashes[start : start + CHUNKS_PER_ROUND]
            engine.kv[:] = 0  # a sentinel: a chunk that is not copied reads as zeros
            lookup = self.call(
                "LookupAndLock",
                storage_pb2.LookupAndLockRequest(
                    keys=common_pb2.KeyGrid(
                        model_name=row(group).model_name, kv_ranks=[0], chunk_hashes=group
                    ),
                    wait_timeout_ms=10_000,
                    request_id="read-back",
                ),
            )
            assert lookup.completed
            retrieved = self.call(
                "RetrieveChunks",
                storage_pb2.RetrieveChunksRequest(
                    engine_id=engine.engine_id,
                    keys=row(group),
                    block_ids=list(range(len(group) * BLOCKS_PER_CHUNK)),
                    chunk_tokens=CHUNK_TOKENS,
                    lease_id=lookup.prefetch_id,
                ),
            )
            assert retrieved.retrieved_chunks == len(group)
            out.update({h: engine.chunk(chunk_blocks(i)) for i, h in enumerate(group)})
        return out


def _storage(
    processes: ProcessFactory,
    tmp_path: Path,
    shm_root: Path,
    coordinator_target: str,
    instance_id: str = "crash-node",
) -> StorageNode:
    data_dir = tmp_path / instance_id
    proc = processes(
        "storage",
        "--instance-id",
        instance_id,
        "--data-dir",
        str(data_dir),
        "--coordinator-target",
        coordinator_target,
        "--l2",
        "disk",
        "--l1-size-bytes",
        str(16 * MIB),
        "--l1-segment-bytes",
        str(4 * MIB),
        "--shm-dir",
        str(shm_root / "l1"),
        "--allowed-memory-dir",
        str(shm_root / "engine"),
        "--event-flush-ms",
        "5",
        "--heartbeat-seconds",
        "0.5",
        "--grace-seconds",
        "0.5",
        "--max-chunks-per-request",
        "64",
    )
    return StorageNode(proc, data_dir, instance_id)


def _directory_of(c: Clients, instance_id: str) -> set[tuple[bytes, int, str, int]]:
    return {
        (k.key.chunk_hash, p.tier, p.backend, p.size_bytes)
        for k in c.list_all(instance_id=instance_id)
        for p in k.placements
    }


def test_storage_sigkilled_during_l2_writes_serves_no_torn_object(
    make_coord: CoordFactory, processes: ProcessFactory, tmp_path: Path, shm_root: Path
) -> None:
    coord = make_coord()
    c = coord.clients
    node = _storage(processes, tmp_path, shm_root, coord.target)
    node.start()
    engine = Engine(shm_root / "engine", "eng-0")
    try:
        node.register(engine)
        rng = np.random.default_rng(1)
        expected: dict[bytes, bytes] = {}
        for _ in range(8):
            expected.update(node.store_round(engine, rng))
        # Kill once write-through has started and before it has finished.
        eventually(lambda: node.status().l2[0].object_count > 0)
        status = node.status()
        assert status.l2[0].object_count < len(expected), (
            "every L2 write finished before the kill; the test did not crash mid-write"
        )
        old_incarnation = status.incarnation
        eventually(lambda: c.stats().l1_keys_by_instance.get(node.instance_id, 0) > 0)
        reported_l2 = {h for h, tier, *_ in _directory_of(c, node.instance_id) if tier == L2}
        node.kill()

        node.start()
        status = node.status()
        assert status.incarnation > old_incarnation
        # The disk index is rebuilt from the files: every whole object, no temp file left.
        l2_objects = node.objects(L2)
        files = [p for p in (node.data_dir / "l2").rglob("*") if p.is_file()]
        assert not [p for p in files if p.name.startswith(".tmp-")]
        assert len([p for p in files if p.name.endswith(".kvl2")]) == len(l2_objects)
        assert status.l2[0].object_count == len(l2_objects)
        stored = [o.key.chunk_hash for o in l2_objects]
        assert set(stored) <= set(expected)
        assert stored  # at least what was on disk before the kill
        # The coordinator saw the new incarnation: the old L1 is fenced, the L2 kept
        # (and the node re-announced its index at start).
        eventually(lambda: c.cursors()[node.instance_id].incarnation == status.incarnation)
        eventually(lambda: _directory_of(c, node.instance_id) == node.placements())
        assert c.stats().l1_keys_by_instance.get(node.instance_id, 0) == 0
        now_l2 = {h for h, tier, *_ in _directory_of(c, node.instance_id) if tier == L2}
        assert reported_l2 <= now_l2
        assert all(
            p.incarnation in (old_incarnation, status.incarnation)
            for k in c.list_all(instance_id=node.instance_id)
            for p in k.placements
        )
        # No torn object is ever served: every object read back has its exact bytes.
        node.register(engine)
        read = node.read_back(engine, stored)
        assert read.keys() == set(stored)
        assert all(read[h] == expected[h] for h in stored)
    finally:
        engine.close()


def test_a_coordinator_down_for_a_while_misses_no_change(
    processes: ProcessFactory, tmp_path: Path, shm_root: Path
) -> None:
    coordinator = processes(
        "coordinator", *_coordinator_args(tmp_path, "--health-check-interval-seconds", "0")
    )
    coordinator.start()
    c = Clients.connect(coordinator.target)
    node = _storage(processes, tmp_path, shm_root, coordinator.target, "down-node")
    node.start()
    engine = Engine(shm_root / "engine", "eng-1")
    try:
        node.register(engine)
        rng = np.random.default_rng(2)
        first = node.store_round(engine, rng)
        eventually(lambda: node.status().l2[0].object_count == len(first))
        eventually(lambda: _directory_of(c, node.instance_id) == node.placements())

        coordinator.stop()  # SIGTERM: the final checkpoint is written
        second = node.store_round(engine, rng)
        gone = list(first)[:8]
        node.call(
            "DeleteKeys",
            storage_pb2.DeleteKeysRequest(keys=[_key(h) for h in gone], tier=common_pb2.TIER_ALL),
        )
        eventually(lambda: node.status().l2[0].object_count == len(first) + len(second) - 8)
        eventually(lambda: node.status().emitter.unacked_batches > 0)
        assert not node.status().emitter.connected

        coordinator.start()
        # EmitterStatus.last_acked_seq is not filled in by the storage app (it reads
        # an attribute the emitter does not have); the window depth is.
        eventually(
            lambda: (s := node.status().emitter).connected and s.unacked_batches == 0,
            timeout=30,
        )
        eventually(lambda: c.cursors()[node.instance_id].last_seq == node.status().emitter.last_seq)
        held = node.placements()
        assert _directory_of(c, node.instance_id) == held
        assert {h for h, *_ in held} == (set(first) - set(gone)) | set(second)
        emitter = node.status().emitter
        cursor = c.cursors()[node.instance_id]
        assert (cursor.incarnation, cursor.last_seq) == (emitter.incarnation, emitter.last_seq)
        assert not cursor.gap_detected
        # Every seq of this incarnation admitted exactly once (resent ones were duplicates).
        assert cursor.batches_admitted == emitter.last_seq
    finally:
        engine.close()
        c.close()


def _key(chunk_hash: bytes) -> common_pb2.ObjectKey:
    return common_pb2.ObjectKey(chunk_hash=chunk_hash, model_name=row([]).model_name)
