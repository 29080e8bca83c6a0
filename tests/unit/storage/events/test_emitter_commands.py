"""Coordinator commands travelling down the event stream, and their effects coming back up."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvmesh.common.errors import NotFound, Unavailable
from kvmesh.common.events import CacheEventEntry, EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.ports import (
    CommandHandler,
    DeleteKeysCommand,
    NodeCommand,
    QuotaChangedCommand,
    ResyncCommand,
)
from kvmesh.storage.events.config import EmitterConfig
from kvmesh.storage.events.emitter import CacheEventEmitter
from kvmesh.storage.events.transport import TransportError
from tests.support.waiting import wait_until
from tests.unit.storage.events.fakes import DEADLINE_S, FakeGate, LoopbackTransport, key, key_id


class FakeNode:
    """A storage node's L2 index that reports its changes through the emitter."""

    def __init__(self) -> None:
        self.emitter: CacheEventEmitter | None = None
        self.l2: dict[ObjectKey, int] = {}
        self.quotas: dict[tuple[str, Tier], int | None] = {}
        self.fail_with: Exception | None = None

    def handle_command(self, command: NodeCommand) -> int:
        assert self.emitter is not None
        if self.fail_with is not None:
            raise self.fail_with
        if isinstance(command, DeleteKeysCommand):
            gone = [k for k in command.keys if self.l2.pop(k, None) is not None]
            self.emitter.record(
                EventType.DELETE,
                command.tier,
                command.backend,
                False,
                [CacheEventEntry(k) for k in gone],
            )
            return len(gone)
        if isinstance(command, ResyncCommand):
            entries = [CacheEventEntry(k, size) for k, size in self.l2.items()]
            self.emitter.record(EventType.STORE, Tier.L2, "fs", False, entries)
            return len(entries)
        self.quotas[(command.cache_salt, command.tier)] = command.quota_bytes
        return 0


class Rig:
    def __init__(self, handler: CommandHandler | None) -> None:
        self.gate = FakeGate()
        self.transport = LoopbackTransport(self.gate)
        self.emitter = CacheEventEmitter(
            EmitterConfig("node-a", 1, flush_interval_s=3600.0, reconnect_base_s=0.001),
            self.transport,
            command_handler=handler,
            rng=random.Random(2),
        )


@pytest.fixture
def node() -> Iterator[tuple[FakeNode, Rig]]:
    fake = FakeNode()
    rig = Rig(fake)
    fake.emitter = rig.emitter
    fake.l2 = {key(i): 100 + i for i in range(4)}
    rig.emitter.start()
    assert wait_until(lambda: rig.transport.connected)
    yield fake, rig
    rig.emitter.close(timeout=1.0)


def test_fake_node_satisfies_the_command_handler_protocol() -> None:
    assert isinstance(FakeNode(), CommandHandler)


def test_delete_command_effects_come_back_as_events_and_the_result_goes_upstream(
    node: tuple[FakeNode, Rig],
) -> None:
    fake, rig = node
    rig.emitter.record(EventType.ACCESS, Tier.L2, "fs", False, [CacheEventEntry(key(0))])

    result = rig.transport.push_command(
        DeleteKeysCommand(
            command_id="del-41", tier=Tier.L2, backend="fs", keys=(key(1), key(2), key(9))
        )
    )

    assert (result.command_id, result.ok, result.affected, result.error) == ("del-41", True, 2, "")
    assert result.effects_through_seq == rig.emitter.last_seq == 2
    assert rig.transport.command_results == [result]
    assert rig.emitter.wait_until_acked(result.effects_through_seq, DEADLINE_S)
    delete = rig.gate.admitted[-1]
    assert delete.event_type is EventType.DELETE
    assert delete.seq <= result.effects_through_seq
    assert [key_id(e) for e in delete.entries] == [1, 2]
    assert sorted(key_id(CacheEventEntry(k)) for k in fake.l2) == [0, 3]


def test_resync_command_reannounces_the_l2_index(node: tuple[FakeNode, Rig]) -> None:
    _, rig = node

    result = rig.transport.push_command(ResyncCommand(command_id="resync-7", tier=Tier.L2))

    assert (result.ok, result.affected) == (True, 4)
    assert rig.emitter.wait_until_acked(result.effects_through_seq, DEADLINE_S)
    stores = [b for b in rig.gate.admitted if b.event_type is EventType.STORE]
    assert sorted(key_id(e) for b in stores for e in b.entries) == [0, 1, 2, 3]


def test_quota_command_without_events_reports_the_current_seq(node: tuple[FakeNode, Rig]) -> None:
    fake, rig = node

    result = rig.transport.push_command(
        QuotaChangedCommand(
            command_id="quota-3", cache_salt="tenant", tier=Tier.L2, quota_bytes=1 << 20
        )
    )

    assert (result.ok, result.affected, result.effects_through_seq) == (True, 0, 0)
    assert fake.quotas == {("tenant", Tier.L2): 1 << 20}


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NotFound("no such backend 'nvme'"), "NOT_FOUND"),
        (Unavailable("L2 down"), "UNAVAILABLE"),
        (RuntimeError("bug"), "INTERNAL"),
    ],
)
def test_a_failing_command_reports_its_status_code(
    node: tuple[FakeNode, Rig], error: Exception, code: str
) -> None:
    fake, rig = node
    fake.fail_with = error

    result = rig.transport.push_command(ResyncCommand(command_id="resync-5"))

    assert (result.command_id, result.ok, result.code) == ("resync-5", False, code)
    assert str(error) in result.message
    assert result.error.startswith(f"{code}: ")
    stats = rig.emitter.stats()
    assert (stats.commands_handled, stats.commands_failed) == (1, 1)


def test_a_node_without_a_handler_answers_unimplemented() -> None:
    rig = Rig(handler=None)
    rig.emitter.start()
    try:
        assert wait_until(lambda: rig.transport.connected)
        result = rig.transport.push_command(ResyncCommand(command_id="resync-1"))
        assert (result.ok, result.code) == (False, "UNIMPLEMENTED")
    finally:
        rig.emitter.close(timeout=1.0)


def test_a_command_needs_a_live_stream() -> None:
    rig = Rig(handler=None)  # never started: no stream
    with pytest.raises(TransportError):
        rig.transport.push_command(ResyncCommand(command_id="resync-1"))
