"""Pieces of the NATS transport that need no server: names, the position section, routing."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.common.nats_names import (
    commands_subject,
    events_subject,
    instance_from_token,
    message_id,
    subject_token,
)
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.persistence import (
    PersistenceType,
    assert_plain_data,
    load_checkpoint,
    save_checkpoint,
)
from kvmesh.coordinator.sources.dispatch import PreferStreamDispatcher
from kvmesh.coordinator.sources.jetstream import NatsEventSource
from kvmesh.coordinator.sources.position import POSITION_SECTION, NatsStreamPosition
from kvmesh.coordinator.sources.settings import NatsSourceSettings
from kvmesh.storage.events.jetstream import StreamSettings


@pytest.mark.parametrize(
    "instance_id",
    ["node-a", "node_1", "host.example.com-8301", "a b", "a*b>", "a%2Eb", "nœud", "a.b"],
)
def test_an_instance_id_is_one_reversible_subject_token(instance_id: str) -> None:
    token = subject_token(instance_id)
    assert all(c.isascii() and (c.isalnum() or c in "_-%") for c in token)
    assert instance_from_token(token) == instance_id
    assert events_subject(instance_id) == f"kvmesh.events.{token}"
    assert commands_subject(instance_id) == f"kvmesh.commands.{token}"


def test_distinct_ids_never_share_a_subject() -> None:
    ids = ["a.b", "a%2Eb", "a%252Eb", "a_b", "a-b", "a b"]
    assert len({subject_token(i) for i in ids}) == len(ids)
    assert message_id("n", 3, 17) == "n/3/17"


def test_stream_settings_refuse_bad_values() -> None:
    config = StreamSettings(max_age_s=60.0).stream_config()
    assert (config.subjects, config.max_age, config.duplicate_window) == (
        ["kvmesh.events.>"],
        60.0,
        60.0,  # never longer than the max age
    )
    for bad in ({"name": "a.b"}, {"max_age_s": -1.0}, {"max_bytes": -1}, {"replicas": 0}):
        with pytest.raises(InvalidArgument):
            StreamSettings(**bad)


def test_the_position_is_a_plain_checkpoint_section_that_restores_by_replacing() -> None:
    """The position is the next seq to read; a restore replaces it."""
    position = NatsStreamPosition("S")
    assert (position.name, position.persistence_type) == (
        POSITION_SECTION,
        PersistenceType.CHECKPOINT,
    )
    position.bind("2024-01-01T00:00:00+00:00")
    position.advance(42)
    position.advance(7)  # never backwards
    capture = position.capture()
    assert_plain_data(capture)
    assert capture == {"stream": "S", "next_seq": 42, "created": "2024-01-01T00:00:00+00:00"}
    position.advance(50)
    assert capture["next_seq"] == 42  # a capture is a copy

    other = NatsStreamPosition("S")
    other.advance(99)
    other.restore(capture)
    assert (other.snapshot(), other.restored) == (("S", 42, "2024-01-01T00:00:00+00:00"), True)
    for bad in (
        [1],
        {"stream": "", "next_seq": 1},
        {"stream": "S", "next_seq": -1},
        {"stream": "S", "next_seq": True},
        {"stream": "S", "next_seq": 1, "created": 5},
    ):
        with pytest.raises(ValueError, match=POSITION_SECTION):
            other.restore(bad)


def test_the_position_is_registered_before_the_checkpoint_loads(tmp_path: object) -> None:
    path = f"{tmp_path}/ckpt"
    core = Coordinator()
    source = NatsEventSource(core, NatsSourceSettings(url="nats://127.0.0.1:1", stream="S"))
    assert source.position in core.checkpoint_components
    source.position.advance(12)
    assert save_checkpoint(path, core.quiesce, core.checkpoint_components).ok

    fresh = Coordinator()
    restored = NatsEventSource(fresh, NatsSourceSettings(url="nats://127.0.0.1:1", stream="S"))
    report = load_checkpoint(path, fresh.checkpoint_components)
    assert POSITION_SECTION in report.restored
    assert restored.position.next_seq == 12


class FakeDispatcher:
    """Records deletes; ``connected`` lists instances with a stream."""

    def __init__(self, connected: set[str], accept: bool = True) -> None:
        self.connected_ids = connected
        self.accept = accept
        self.sent: list[str] = []

    def connected(self, instance_id: str) -> bool:
        return instance_id in self.connected_ids

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> bool:
        self.sent.append(instance_id)
        return self.accept


def test_deletes_prefer_the_grpc_stream_and_fall_back_to_nats() -> None:
    streams = FakeDispatcher({"grpc-node", "closing-node"})
    nats = FakeDispatcher(set())
    dispatcher = PreferStreamDispatcher(streams, nats)  # type: ignore[arg-type]
    key = ObjectKey(b"\x01" * 32, "m", 0, 0, "")
    assert dispatcher.dispatch_delete("grpc-node", Tier.L2, "disk", [key])
    assert dispatcher.dispatch_delete("nats-node", Tier.L2, "disk", [key])
    streams.accept = False  # the stream closed between the check and the send
    assert dispatcher.dispatch_delete("closing-node", Tier.L1, "", [key])
    assert streams.sent == ["grpc-node", "closing-node"]
    assert nats.sent == ["nats-node", "closing-node"]
    nats.accept = False
    assert not dispatcher.dispatch_delete("nats-node", Tier.L1, "", [key])
