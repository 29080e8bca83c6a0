"""A fleet whose nodes report over NATS JetStream: real nats-server, real apps.

* Every placement change of a node reaches the directory exactly once, and
  the stream holds each batch once.
* Events published while the coordinator is down (from the start, or after a
  SIGKILL that followed a checkpoint) wait in JetStream and are replayed; the
  directory ends up equal to what the node holds, with no cursor gap.
* A clean restart resumes at the checkpointed stream position (nothing is
  replayed twice).
* A coordinator delete reaches a NATS node as a command and its DELETE events
  come back through the stream.
"""

from __future__ import annotations

import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import admin_pb2, directory_pb2, policy_pb2
from kvmesh.cli.status import collect, render
from tests.integration.coordinator.support import Clients, CliProcess, eventually
from tests.integration.nats.conftest import Fleet
from tests.integration.nats.support import (
    RawNats,
    batch_seqs,
    directory_of,
    node_placements,
    wait_caught_up,
    wait_settled,
    wait_true,
)
from tests.integration.storage.support import MODEL, Engine, Node, chunk_blocks, new_hashes
from tests.support.ports import free_port


def store(node: Node, engine: Engine, count: int) -> list[bytes]:
    """Store ``count`` fresh chunks (L1, written through to the disk L2); their hashes."""
    hashes = new_hashes(count)
    blocks = [b for i in range(count) for b in chunk_blocks(i)]
    outcomes = node.store(engine, hashes, blocks)
    assert len(outcomes) == count
    return hashes


def wait_l2(node: Node, expected: set[bytes]) -> None:
    """Wait until the node's disk L2 holds exactly ``expected`` (write-through is async)."""
    wait_true(lambda: node.l2_hashes() == expected)


def wire_keys(hashes: list[bytes]) -> directory_pb2.KeyList:
    """The directory keys of chunks stored by :func:`store`."""
    return directory_pb2.KeyList(
        keys=[common_pb2.ObjectKey(chunk_hash=h, model_name=MODEL) for h in hashes]
    )


def test_every_placement_change_reaches_the_directory_exactly_once(fleet: Fleet) -> None:
    """Messages are applied in stream order, each once."""
    # The coordinator starts first: the stream does not exist until the node creates it.
    coord = fleet.coordinator()
    c = coord.clients
    node = fleet.storage(coordinator_target=coord.target)
    instance = node.app.instance_id
    engine = fleet.engine(node)
    hashes = [h for _ in range(3) for h in store(node, engine, 8)]
    wait_l2(node, set(hashes))
    node.wait_written_through(hashes)  # an L1 delete skips what the write-through still locks
    node.delete(hashes[:5], tier=common_pb2.TIER_ALL)
    wait_l2(node, set(hashes[5:]))

    wait_caught_up(c, node)
    held = node_placements(node)
    assert {h for h, *_ in held} == set(hashes[5:])
    assert directory_of(c, instance) == held
    last_seq = node.status().emitter.last_seq
    cursor = c.cursors()[instance]
    assert (cursor.last_seq, cursor.gap_detected) == (last_seq, False)
    assert (cursor.batches_admitted, cursor.batches_duplicate) == (last_seq, 0)
    # JetStream holds every batch once, in seq order.
    raw = RawNats(fleet.thread, fleet.nats_url)
    try:
        messages = raw.stream_messages()
        assert batch_seqs(messages, instance) == list(range(1, last_seq + 1))
        stats = coord.app.nats.stats() if coord.app.nats is not None else None
        assert stats is not None
        assert stats.connected
        assert (stats.admitted, stats.duplicate, stats.skipped) == (last_seq, 0, 0)
        assert stats.next_seq == raw.stream_state().last_seq + 1
    finally:
        raw.close()


def test_events_wait_in_the_stream_while_no_coordinator_runs(fleet: Fleet) -> None:
    """Without a position the source reads from the stream's first message."""
    node = fleet.storage()  # NATS only: no coordinator anywhere yet
    instance = node.app.instance_id
    engine = fleet.engine(node)
    hashes = store(node, engine, 8) + store(node, engine, 8)
    wait_l2(node, set(hashes))
    # Acked by JetStream: durably stored although no coordinator ever ran.
    acked_before = wait_settled(node)

    coord = fleet.coordinator()
    c = coord.clients
    wait_caught_up(c, node)
    assert directory_of(c, instance) == node_placements(node)
    cursor = c.cursors()[instance]
    # The L2 shows a write before the node has flushed its event, so a batch may
    # follow the first settled moment: every batch the node sent counts, from seq 1.
    last_seq = int(node.status().emitter.last_seq)
    assert last_seq >= acked_before
    assert (cursor.last_seq, cursor.gap_detected, cursor.batches_admitted) == (
        last_seq,
        False,
        last_seq,
    )


def test_a_clean_restart_resumes_at_the_checkpointed_position(fleet: Fleet) -> None:
    """A restored position resumes after the last applied message."""
    checkpoint = str(fleet.tmp_path / "coordinator.ckpt")
    coord = fleet.coordinator(checkpoint_path=checkpoint)
    node = fleet.storage()
    instance = node.app.instance_id
    engine = fleet.engine(node)
    first = store(node, engine, 8)
    wait_l2(node, set(first))
    wait_caught_up(coord.clients, node)
    source = coord.app.nats
    assert source is not None
    position = source.position.next_seq
    fleet.stop_coordinator(coord)  # the final checkpoint holds the position

    second = store(node, engine, 8)
    wait_l2(node, set(first) | set(second))
    restarted = fleet.coordinator(checkpoint_path=checkpoint)
    source = restarted.app.nats
    assert source is not None
    assert source.position.restored
    wait_caught_up(restarted.clients, node)
    assert directory_of(restarted.clients, instance) == node_placements(node)
    stats = source.stats()
    # Only what followed the position was read: nothing came back as a duplicate.
    assert stats.duplicate == 0
    assert stats.admitted == node.status().emitter.last_seq - (position - 1)
    assert not restarted.clients.cursors()[instance].gap_detected


@pytest.mark.slow
def test_a_coordinator_sigkilled_after_a_checkpoint_replays_what_followed(
    fleet: Fleet,
) -> None:
    """A restored position that is behind replays what followed it."""
    proc = CliProcess(
        "coordinator",
        free_port(),
        [
            "--log-level",
            "WARNING",
            "--chunk-size",
            "4",
            "--grace-seconds",
            "0.2",
            "--checkpoint-path",
            str(fleet.tmp_path / "coordinator.ckpt"),
            "--checkpoint-interval-seconds",
            "0",
            "--eviction-check-interval-seconds",
            "0",
            "--health-check-interval-seconds",
            "0",
            "--nats-url",
            fleet.nats_url,
        ],
    )
    c: Clients | None = None
    try:
        proc.start()
        c = Clients.connect(proc.target)
        node = fleet.storage(coordinator_target=proc.target)
        instance = node.app.instance_id
        engine = fleet.engine(node)
        first = store(node, engine, 8)
        wait_l2(node, set(first))
        wait_caught_up(c, node)
        assert c.admin.checkpoint(admin_pb2.CheckpointRequest()).size_bytes > 0

        # Admitted after the checkpoint, then lost with the process...
        second = store(node, engine, 8)
        node.delete(first[:3], tier=common_pb2.TIER_ALL)
        wait_l2(node, set(first[3:]) | set(second))
        wait_caught_up(c, node)
        assert directory_of(c, instance) == node_placements(node)
        proc.kill()

        # ...and published while no coordinator runs: JetStream acks them.
        before_outage = node.status().emitter.last_seq
        third = store(node, engine, 8)
        node.delete(second[:2], tier=common_pb2.TIER_ALL)
        wait_l2(node, set(first[3:]) | set(second[2:]) | set(third))
        assert wait_settled(node) > before_outage

        proc.start()
        wait_caught_up(c, node, timeout=30)
        held = node_placements(node)
        assert {h for h, *_ in held} == set(first[3:]) | set(second[2:]) | set(third)
        assert directory_of(c, instance) == held
        emitter = node.status().emitter
        cursor = c.cursors()[instance]
        assert (cursor.incarnation, cursor.last_seq, cursor.gap_detected) == (
            emitter.incarnation,
            emitter.last_seq,
            False,
        )
    finally:
        proc.kill()
        if c is not None:
            c.close()


def test_a_delete_reaches_a_nats_node_and_its_deletes_come_back(fleet: Fleet) -> None:
    coord = fleet.coordinator()
    c = coord.clients
    # Membership over gRPC (the coordinator must know the node is live), events over NATS.
    node = fleet.storage(coordinator_target=coord.target)
    instance = node.app.instance_id
    engine = fleet.engine(node)
    hashes = store(node, engine, 8)
    wait_l2(node, set(hashes))
    wait_caught_up(c, node)
    eventually(lambda: instance in c.instances())
    assert coord.app.streams.count() == 0  # no gRPC event stream: commands must go over NATS

    response = c.policy.delete_keys(
        policy_pb2.DeleteKeysRequest(
            instance_id=instance, keys=wire_keys(hashes[:3]), tier=common_pb2.TIER_ALL
        )
    )
    assert response.dispatched_keys == 6  # three keys, both tiers
    wait_l2(node, set(hashes[3:]))
    wait_true(lambda: {h for h, *_ in node_placements(node)} == set(hashes[3:]))
    wait_caught_up(c, node)
    assert directory_of(c, instance) == node_placements(node)
    assert all(not c.placements(k) for k in wire_keys(hashes[:3]).keys)
    source = coord.app.nats
    assert source is not None
    assert source.stats().commands_sent == 2
    # Both results came back over NATS, recorded beside the gRPC streams' results.
    wait_true(lambda: len(coord.app.streams.command_results) == 2)
    results = list(coord.app.streams.command_results.values())
    assert [r.code for r in results] == ["OK", "OK"]
    assert sum(r.affected for r in results) == 6


def test_kvmesh_status_shows_the_stream_position_and_lag(fleet: Fleet) -> None:
    """The source's status (LMCache: ("kafka", SEEKABLE)) is in GetStatus."""
    coord = fleet.coordinator()
    node = fleet.storage(coordinator_target=coord.target)
    engine = fleet.engine(node)
    wait_l2(node, set(store(node, engine, 4)))
    wait_caught_up(coord.clients, node)
    source = coord.app.nats
    assert source is not None
    wait_true(lambda: source.stats().pending == 0)
    stats = source.stats()

    reply = coord.clients.admin.get_status(admin_pb2.GetStatusRequest())
    assert reply.HasField("nats")
    assert (reply.nats.stream, reply.nats.connected) == (stats.stream, True)
    assert reply.nats.next_seq == stats.next_seq > 1
    assert (reply.nats.pending, reply.nats.applied, reply.nats.skipped) == (0, stats.applied, 0)
    shown = render(collect(coord.target), coord.target)
    assert f"NATS stream {stats.stream}: connected, next seq {stats.next_seq}, 0 pending" in shown


def test_a_coordinator_without_nats_reports_no_stream(fleet: Fleet) -> None:
    coord = fleet.coordinator(nats_url="")
    reply = coord.clients.admin.get_status(admin_pb2.GetStatusRequest())
    assert not reply.HasField("nats")
    assert "NATS" not in render(collect(coord.target), coord.target)
