"""Coordinator commands against real ``kvmesh storage`` processes, and what comes back.

* Operator deletes (PolicyService.DeleteKeys) by tier — L1, L2, ALL, with
  and without a named node — reach the node's own backends (L1 and every L2
  adapter): the node answers OK, the chunks leave exactly those tiers, and
  the directory follows.
* A node paused (SIGSTOP) past the heartbeat timeout is dropped and its L1
  placements fenced; resumed (SIGCONT, same process and incarnation), it is
  asked to resync and the directory's placements for it equal what it holds.
* A command the node refuses reaches the operator: in DeleteKeys' response
  (synchronous), and for eviction's deletes (asynchronous) in
  AdminService.GetStatus, ``kvmesh status`` and the Prometheus counter
  ``kvmesh_coordinator_command_results_total{command,result}``.

Every child process is killed in ``finally``, also when a test fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import admin_pb2, directory_pb2, policy_pb2
from kvmesh.api.storage.v1 import storage_pb2, storage_pb2_grpc
from kvmesh.cli.status import collect, render
from tests.integration.coordinator.conftest import CoordFactory
from tests.integration.coordinator.support import L1, L2, Clients, CliProcess, eventually
from tests.integration.storage.support import (
    CHUNK_TOKENS,
    NUM_BLOCKS,
    Engine,
    new_hashes,
    object_keys,
    row,
)
from tests.support.ports import free_port

MIB = 1 << 20
ALL = common_pb2.TIER_ALL
MEMORY_L2 = '{"type": "memory"}'

ProcessFactory = Callable[..., CliProcess]
Placement = tuple[bytes, int, str, int]


@pytest.fixture
def processes() -> Iterator[ProcessFactory]:
    """Make ``CliProcess`` handles (not started); every one is killed at the end."""
    made: list[CliProcess] = []

    def make(service: str, *args: str) -> CliProcess:
        proc = CliProcess(service, free_port(), ["--log-level", "WARNING", *args])
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            if proc.proc is not None and proc.proc.poll() is None:
                # A stopped process still dies of SIGKILL; SIGCONT first so it can be reaped.
                proc.proc.send_signal(signal.SIGCONT)
            proc.kill()


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """This test's directory under /dev/shm (L1 segments, engine files)."""
    root = Path("/dev/shm") / f"kvmesh-cmd-it-{uuid.uuid4().hex[:12]}"
    (root / "l1").mkdir(parents=True)
    (root / "engine").mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


class NodeProcess:
    """A ``kvmesh storage`` process reporting to a coordinator, and a blocking stub to it."""

    def __init__(
        self,
        processes: ProcessFactory,
        tmp_path: Path,
        shm_root: Path,
        coordinator: str,
        l2: list[str],
    ) -> None:
        self.instance_id = f"cmd-node-{uuid.uuid4().hex[:8]}"
        self.shm_root = shm_root
        self._args = [
            "--instance-id",
            self.instance_id,
            "--data-dir",
            str(tmp_path / self.instance_id),
            "--coordinator-target",
            coordinator,
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
            "0.2",
            "--grace-seconds",
            "0.5",
            "--max-chunks-per-request",
            "64",
        ]
        self._processes = processes
        self.proc = self._new_process(l2)
        self.channel: grpc.Channel | None = None
        self.stub: storage_pb2_grpc.StorageServiceStub | None = None

    def _new_process(self, l2: list[str]) -> CliProcess:
        l2_args = [arg for spec in l2 for arg in ("--l2", spec)]
        return self._processes("storage", *self._args, *l2_args)

    def start(self) -> None:
        self.proc.start()
        self.channel = grpc.insecure_channel(self.proc.target)
        self.stub = storage_pb2_grpc.StorageServiceStub(self.channel)

    def restart(self, l2: list[str]) -> None:
        """Kill the process and start a new one (a new incarnation) with other L2 adapters."""
        self.proc.kill()
        if self.channel is not None:
            self.channel.close()
        self.proc = self._new_process(l2)
        self.start()

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    def call(self, method: str, request: Any) -> Any:
        assert self.stub is not None
        return getattr(self.stub, method)(request, timeout=30)

    def store(self, n: int, seed: int) -> list[bytes]:
        """Store ``n`` fresh chunks (n <= NUM_BLOCKS / blocks per chunk) from a new engine."""
        engine = Engine(self.shm_root / "engine", f"eng-{uuid.uuid4().hex[:8]}")
        try:
            engine.kv[:] = np.random.default_rng(seed).standard_normal(engine.kv.shape)
            self.call("RegisterEngineMemory", engine.register_request())
            hashes = new_hashes(n)
            response = self.call(
                "StoreChunks",
                storage_pb2.StoreChunksRequest(
                    engine_id=engine.engine_id,
                    keys=row(hashes),
                    block_ids=list(range(NUM_BLOCKS)),
                    chunk_tokens=CHUNK_TOKENS,
                ),
            )
            assert list(response.outcomes) == [storage_pb2.STORE_OUTCOME_STORED] * n
            self.call(
                "UnregisterEngineMemory",
                storage_pb2.UnregisterEngineMemoryRequest(engine_id=engine.engine_id),
            )
        finally:
            engine.close()
        return hashes

    def placements(self) -> set[Placement]:
        """What the node holds, as the directory should show it: (hash, tier, backend, size)."""
        out: set[Placement] = set()
        token = ""
        while True:
            page = self.call(
                "ListObjects", storage_pb2.ListObjectsRequest(tier=ALL, page_token=token)
            )
            out.update((o.key.chunk_hash, o.tier, o.backend, o.size_bytes) for o in page.objects)
            token = page.next_page_token
            if not token:
                return out

    def read_locked_objects(self) -> int:
        """L1 objects under a read lock (the write-through holds one until its batch is done)."""
        status = self.call("GetStatus", storage_pb2.GetStatusRequest())
        return int(status.l1.read_locked_objects)

    def held(self, tier: int, backend: str | None = None) -> set[bytes]:
        """Chunk hashes the node holds on ``tier`` (and ``backend``)."""
        return {h for h, t, b, _ in self.placements() if t == tier and backend in (None, b)}


def directory_of(c: Clients, instance_id: str) -> set[Placement]:
    """The directory's placements of ``instance_id``: (hash, tier, backend, size)."""
    return {
        (k.key.chunk_hash, p.tier, p.backend, p.size_bytes)
        for k in c.list_all(instance_id=instance_id)
        for p in k.placements
        if p.instance_id == instance_id
    }


def in_sync(c: Clients, node: NodeProcess) -> bool:
    """True when the directory shows exactly what the node holds."""
    return directory_of(c, node.instance_id) == node.placements()


def keys(hashes: list[bytes]) -> directory_pb2.KeyList:
    return directory_pb2.KeyList(keys=object_keys(hashes))


def answers(response: policy_pb2.DeleteKeysResponse) -> set[tuple[int, str, str, int]]:
    """(tier, backend, code, affected) of each command of a DeleteKeys response."""
    return {(c.tier, c.backend, c.code, c.affected) for c in response.commands}


# ----------------------------------------------------------------------------- deletes


def test_operator_deletes_by_tier_reach_the_nodes_own_backends(
    make_coord: CoordFactory, processes: ProcessFactory, tmp_path: Path, shm_root: Path
) -> None:
    coord = make_coord()
    c = coord.clients
    node = NodeProcess(processes, tmp_path, shm_root, coord.target, ["disk", MEMORY_L2])
    node.start()
    iid = node.instance_id
    hashes = node.store(12, seed=1)
    every = set(hashes)
    # The adapters list a key before the write-through gives back its L1 read
    # locks, and an L1 delete skips a locked object: wait for both.
    eventually(
        lambda: (
            node.held(L2, "disk") == every
            and node.held(L2, "memory") == every
            and node.read_locked_objects() == 0
        )
    )
    eventually(lambda: in_sync(c, node))
    l1_l2 = [(L1, "dram"), (L2, "disk"), (L2, "memory")]

    # L1, by placement (no node named): the coordinator names L1's backend, "dram".
    r = c.policy.delete_keys(policy_pb2.DeleteKeysRequest(keys=keys(hashes[0:2]), tier=L1))
    assert (r.dispatched_keys, r.refused_commands, r.unanswered_commands) == (2, 0, 0)
    assert answers(r) == {(L1, "dram", "OK", 2)}
    assert r.deleted_keys == 2
    # L1 on the named node: every backend of the tier.
    r = c.policy.delete_keys(
        policy_pb2.DeleteKeysRequest(instance_id=iid, keys=keys(hashes[2:4]), tier=L1)
    )
    assert answers(r) == {(L1, "", "OK", 2)}
    eventually(lambda: node.held(L1) == every - set(hashes[0:4]))
    assert node.held(L2, "disk") == node.held(L2, "memory") == every

    # L2, by placement: one command per adapter; on the named node: every adapter.
    r = c.policy.delete_keys(policy_pb2.DeleteKeysRequest(keys=keys(hashes[4:6]), tier=L2))
    assert answers(r) == {(L2, "disk", "OK", 2), (L2, "memory", "OK", 2)}
    r = c.policy.delete_keys(
        policy_pb2.DeleteKeysRequest(instance_id=iid, keys=keys(hashes[6:8]), tier=L2)
    )
    assert answers(r) == {(L2, "", "OK", 4)}  # two keys on two adapters
    assert r.deleted_keys == 4
    eventually(lambda: node.held(L2, "memory") == every - set(hashes[4:8]))
    assert node.held(L2, "disk") == every - set(hashes[4:8])
    assert node.held(L1) == every - set(hashes[0:4])

    # ALL, by placement and on the named node: every backend of both tiers.
    r = c.policy.delete_keys(policy_pb2.DeleteKeysRequest(keys=keys(hashes[8:10]), tier=ALL))
    assert {(t, b, code) for t, b, code, _ in answers(r)} == {(t, b, "OK") for t, b in l1_l2}
    assert r.deleted_keys == 6
    r = c.policy.delete_keys(
        policy_pb2.DeleteKeysRequest(instance_id=iid, keys=keys(hashes[10:12]))
    )
    assert answers(r) == {(L1, "", "OK", 2), (L2, "", "OK", 4)}
    # Each chunk is left exactly where no delete named its tier.
    eventually(lambda: node.held(L1) == set(hashes[4:8]))
    assert node.held(L2, "disk") == node.held(L2, "memory") == set(hashes[0:4])
    # The directory follows the nodes' DELETE events.
    eventually(lambda: in_sync(c, node))
    status = c.admin.get_status(admin_pb2.GetStatusRequest())
    counts = {(r.command, r.result): r.count for r in status.command_results}
    assert counts[("delete_keys", "OK")] == 10  # 1 + 1 (L1), 2 + 1 (L2), 3 + 2 (ALL)
    assert not any(result != "OK" for _, result in counts)


# ------------------------------------------------------------------------------ resync


def test_a_node_paused_past_the_heartbeat_timeout_is_resynced_when_it_resumes(
    make_coord: CoordFactory, processes: ProcessFactory, tmp_path: Path, shm_root: Path
) -> None:
    coord = make_coord(
        instance_timeout_seconds=1.0,
        health_check_interval_seconds=0.1,
        heartbeat_interval_seconds=0.2,
    )
    c = coord.clients
    node = NodeProcess(processes, tmp_path, shm_root, coord.target, ["disk"])
    node.start()
    iid = node.instance_id
    hashes = set(node.store(16, seed=2))
    eventually(lambda: node.held(L2) == hashes)
    eventually(lambda: in_sync(c, node))
    assert node.held(L1) == hashes
    incarnation = c.cursors()[iid].incarnation

    def resyncs() -> tuple[int, int]:
        """(resyncs asked, resync commands the node carried out)."""
        status = c.admin.get_status(admin_pb2.GetStatusRequest())
        counts = {(r.command, r.result): r.count for r in status.command_results}
        return status.resyncs_requested, counts.get(("resync", "OK"), 0)

    # Its first stream open was a resync (the coordinator did not know it yet).
    eventually(lambda: resyncs()[1] == 2)
    asked, done = resyncs()

    os.kill(node.pid, signal.SIGSTOP)
    try:
        # Dropped: unregistered, cursor forgotten, its L1 placements fenced (L2 kept).
        eventually(lambda: iid not in c.instances() and iid not in c.cursors())
        assert {(h, t) for h, t, *_ in directory_of(c, iid)} == {(h, L2) for h in hashes}
    finally:
        os.kill(node.pid, signal.SIGCONT)

    # The same process, the same incarnation, L1 intact: it re-registers, is asked
    # to resync, and the directory shows everything it holds again.
    eventually(lambda: iid in c.instances(), timeout=30)
    eventually(lambda: in_sync(c, node), timeout=30)
    held = node.placements()
    assert {h for h, t, *_ in held if t == L1} == hashes
    assert directory_of(c, iid) == held
    cursor = c.cursors()[iid]
    assert cursor.incarnation == incarnation
    assert cursor.gap_detected  # the hole the drop left, which is what asked for the resync
    eventually(lambda: resyncs()[1] >= done + 2)  # L1 and L2, carried out
    assert resyncs()[0] > asked


# --------------------------------------------------------------------------- refusals


def _metrics(coord: Any) -> str:
    registry = CollectorRegistry()
    for collector in coord.app.collectors():
        registry.register(collector)
    return generate_latest(registry).decode()


def test_a_command_the_node_refuses_reaches_the_operator(
    make_coord: CoordFactory, processes: ProcessFactory, tmp_path: Path, shm_root: Path
) -> None:
    coord = make_coord()
    c = coord.clients
    node = NodeProcess(processes, tmp_path, shm_root, coord.target, ["disk"])
    node.start()
    iid = node.instance_id
    hashes = node.store(4, seed=3)
    eventually(lambda: node.held(L2) == set(hashes))
    eventually(lambda: in_sync(c, node))
    # The operator reconfigures the node without its disk: the directory still
    # places the chunks on the node's "disk" (L2 outlives the process), which the
    # new process does not have, so it refuses deletes naming it.
    old_incarnation = c.cursors()[iid].incarnation
    node.restart(["none"])
    eventually(lambda: c.cursors()[iid].incarnation > old_incarnation)
    eventually(lambda: {t for _, t, *_ in directory_of(c, iid)} == {L2})

    # Synchronous: DeleteKeys returns the node's refusal.
    r = c.policy.delete_keys(policy_pb2.DeleteKeysRequest(keys=keys(hashes[:2]), tier=L2))
    assert r.dispatched_keys == 2  # the stream took the command ...
    assert (r.refused_commands, r.deleted_keys) == (1, 0)  # ... and the node refused it
    [refused] = r.commands
    assert (refused.instance_id, refused.tier, refused.backend) == (iid, L2, "disk")
    assert (refused.sent, refused.code) == (True, "INVALID_ARGUMENT")
    assert "'disk'" in refused.message

    # Asynchronous: eviction's deletes (quota 0 for the default salt) are refused too.
    c.policy.set_quota(policy_pb2.SetQuotaRequest(cache_salt="", tier=L2, limit_bytes=0))
    eventually(coord.app.core.eviction.is_ready)
    run = c.policy.run_eviction(policy_pb2.RunEvictionRequest())
    assert run.dispatched_commands == 1

    def refused_deletes() -> int:
        status = c.admin.get_status(admin_pb2.GetStatusRequest())
        counts = {(r.command, r.result): r.count for r in status.command_results}
        return counts.get(("delete_keys", "INVALID_ARGUMENT"), 0)

    eventually(lambda: refused_deletes() == 2)
    status = c.admin.get_status(admin_pb2.GetStatusRequest())
    latest = status.recent_command_failures[0]
    assert (latest.instance_id, latest.command, latest.code) == (
        iid,
        "delete_keys",
        "INVALID_ARGUMENT",
    )
    assert "'disk'" in latest.message
    assert "L2 disk" in latest.summary
    assert latest.answered_at.seconds > 0

    # kvmesh status shows the refusals with the node's reason.
    text = render(collect(coord.target), coord.target)
    assert "REFUSED node commands: 2" in text
    assert "INVALID_ARGUMENT" in text
    assert iid in text
    assert latest.message in text

    # And Prometheus counts them by command and result.
    metrics = _metrics(coord)
    assert (
        'kvmesh_coordinator_command_results_total{command="delete_keys",'
        'result="INVALID_ARGUMENT"} 2.0'
    ) in metrics
