"""The storage node's membership loop (docs/events.md, "Registrar")."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import pytest

from kvmesh.common.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.storage.events.registrar import MembershipClient, Registrar, Registration
from tests.support.waiting import wait_until
from tests.unit.storage.events.fakes import DEADLINE_S

META = {"address": "10.0.0.5:7100", "incarnation": "12"}


class FakeCoordinator:
    """Membership with the coordinator's semantics, plus scripted failures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.known: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.metadata: list[dict[str, str]] = []
        self.failures: dict[str, list[Exception]] = {
            "register": [],
            "heartbeat": [],
            "deregister": [],
        }
        self.unreachable = False
        self.scripted_replies: list[Any] = []
        self.assign_id: str | None = None
        self.heartbeat_seen = threading.Event()
        self.deregistered = threading.Event()

    def _maybe_fail(self, op: str) -> None:
        if self.unreachable:
            raise Unavailable("connection refused")
        if self.failures[op]:
            raise self.failures[op].pop(0)

    def register(self, instance_id: str, metadata: Mapping[str, str]) -> Registration:
        with self.lock:
            self.calls.append(("register", instance_id))
            self.metadata.append(dict(metadata))
            self._maybe_fail("register")
            if self.scripted_replies:
                return self.scripted_replies.pop(0)  # type: ignore[no-any-return]
            assigned = self.assign_id or instance_id
            existed = assigned in self.known
            self.known.add(assigned)
            return Registration(instance_id=assigned, re_registered=existed)

    def heartbeat(self, instance_id: str) -> None:
        with self.lock:
            self.calls.append(("heartbeat", instance_id))
            self._maybe_fail("heartbeat")
            if instance_id not in self.known:
                raise NotFound(f"instance {instance_id} is not registered")
        self.heartbeat_seen.set()

    def deregister(self, instance_id: str) -> None:
        with self.lock:
            self.calls.append(("deregister", instance_id))
            self._maybe_fail("deregister")
            self.known.discard(instance_id)
        self.deregistered.set()

    def ops(self) -> list[str]:
        with self.lock:
            return [op for op, _ in self.calls]

    def forget_everything(self) -> None:
        """A cold restart: the registry is empty."""
        with self.lock:
            self.known.clear()


def make(coordinator: FakeCoordinator, **kwargs: Any) -> tuple[Registrar, list[Registration]]:
    seen: list[Registration] = []
    registrar = Registrar(coordinator, "node-a", META, on_registered=seen.append, **kwargs)
    return registrar, seen


def test_fake_coordinator_satisfies_the_client_protocol() -> None:
    client: MembershipClient = FakeCoordinator()
    assert client is not None


def test_first_tick_registers_with_metadata_and_fires_on_registered() -> None:
    coord = FakeCoordinator()
    registrar, seen = make(coord)

    registrar.tick()

    assert coord.calls == [("register", "node-a")]
    assert coord.metadata == [META]
    assert registrar.registered_id == "node-a"
    assert seen == [Registration("node-a", re_registered=False)]


def test_registered_ticks_heartbeat_with_the_held_id() -> None:
    coord = FakeCoordinator()
    registrar, _ = make(coord)

    for _ in range(3):
        registrar.tick()

    assert coord.calls == [("register", "node-a"), ("heartbeat", "node-a"), ("heartbeat", "node-a")]
    assert registrar.stats().heartbeats == 2


def test_the_id_the_coordinator_assigns_is_used_for_heartbeats_and_deregistration() -> None:
    coord = FakeCoordinator()
    coord.assign_id = "assigned-7"
    registrar, _ = make(coord)

    registrar.tick()
    registrar.tick()
    registrar.stop()

    assert coord.calls[1:] == [("heartbeat", "assigned-7"), ("deregister", "assigned-7")]


def test_the_heartbeat_interval_follows_the_coordinator_when_it_states_one() -> None:
    coord = FakeCoordinator()
    coord.scripted_replies = [Registration("node-a", re_registered=False, heartbeat_interval_s=2.5)]
    registrar, _ = make(coord)
    assert registrar.heartbeat_interval_s == 5.0

    registrar.tick()

    assert registrar.heartbeat_interval_s == 2.5


def test_not_found_drops_the_id_and_the_next_tick_registers_again() -> None:
    coord = FakeCoordinator()
    registrar, seen = make(coord)
    registrar.tick()
    coord.forget_everything()

    registrar.tick()  # heartbeat → NOT_FOUND
    assert registrar.registered_id is None
    registrar.tick()

    assert coord.ops() == ["register", "heartbeat", "register"]
    assert registrar.registered_id == "node-a"
    assert len(seen) == 2  # on_registered fires on every registration
    assert registrar.stats().heartbeats_not_found == 1


def test_a_transient_error_keeps_the_id_without_a_duplicate_registration() -> None:
    coord = FakeCoordinator()
    registrar, seen = make(coord)
    registrar.tick()
    coord.failures["heartbeat"].append(Unavailable("503 from the coordinator"))

    registrar.tick()
    assert registrar.registered_id == "node-a"
    registrar.tick()
    registrar.stop()

    assert coord.ops() == ["register", "heartbeat", "heartbeat", "deregister"]
    assert len(seen) == 1
    stats = registrar.stats()
    assert (stats.errors, stats.registrations) == (1, 1)
    assert "503" in stats.last_error


def test_a_malformed_reply_or_unreachable_coordinator_is_retried_next_tick() -> None:
    coord = FakeCoordinator()
    coord.scripted_replies = [None, Registration("", re_registered=False)]
    registrar, seen = make(coord)

    registrar.tick()
    registrar.tick()
    coord.unreachable = True
    registrar.tick()
    assert registrar.registered_id is None
    coord.unreachable = False
    registrar.tick()

    assert registrar.registered_id == "node-a"
    assert registrar.stats().errors == 3
    assert len(seen) == 1


def test_an_exception_in_on_registered_does_not_undo_the_registration() -> None:
    coord = FakeCoordinator()

    def explode(_: Registration) -> None:
        raise RuntimeError("capacity publish failed")

    registrar = Registrar(coord, "node-a", META, on_registered=explode)
    registrar.tick()
    registrar.tick()

    assert registrar.registered_id == "node-a"
    assert coord.ops() == ["register", "heartbeat"]


def test_the_loop_registers_at_once_heartbeats_and_deregisters_on_stop() -> None:
    coord = FakeCoordinator()
    registered = threading.Event()
    registrar = Registrar(
        coord, "node-a", META, heartbeat_interval_s=0.005, on_registered=lambda _: registered.set()
    )
    registrar.start()
    try:
        assert registered.wait(DEADLINE_S)
        assert wait_until(lambda: coord.ops().count("heartbeat") >= 3)
    finally:
        registrar.stop(timeout=DEADLINE_S)

    assert coord.deregistered.is_set()
    assert coord.ops()[0] == "register"
    assert coord.ops()[-1] == "deregister"
    assert coord.ops().count("register") == 1
    assert registrar.registered_id is None


def test_the_first_attempt_does_not_wait_for_the_interval_and_stop_interrupts_the_wait() -> None:
    coord = FakeCoordinator()
    registered = threading.Event()
    registrar = Registrar(
        coord, "node-a", META, heartbeat_interval_s=3600.0, on_registered=lambda _: registered.set()
    )
    registrar.start()

    assert registered.wait(DEADLINE_S)
    registrar.stop(timeout=DEADLINE_S)

    assert coord.ops() == ["register", "deregister"]
    assert not [t for t in threading.enumerate() if t.name == "registrar-node-a"]


def test_the_loop_survives_an_unreachable_coordinator_and_registers_when_it_returns() -> None:
    coord = FakeCoordinator()
    coord.unreachable = True
    registrar, seen = make(coord, heartbeat_interval_s=0.005)
    registrar.start()
    try:
        assert wait_until(lambda: registrar.stats().errors >= 3)
        coord.unreachable = False
        assert coord.heartbeat_seen.wait(DEADLINE_S)
    finally:
        registrar.stop(timeout=DEADLINE_S)
    assert len(seen) == 1
    assert coord.ops()[-1] == "deregister"


def test_deregistration_errors_are_suppressed() -> None:
    coord = FakeCoordinator()
    registrar, _ = make(coord)
    registrar.tick()
    coord.failures["deregister"].append(Unavailable("down"))

    registrar.stop()  # does not raise

    assert coord.ops() == ["register", "deregister"]


def test_stop_without_a_registration_does_not_deregister() -> None:
    coord = FakeCoordinator()
    coord.unreachable = True
    registrar, _ = make(coord)
    registrar.tick()

    registrar.stop()

    assert coord.ops() == ["register"]


@pytest.mark.parametrize("interval", [0.0, -1.0, float("inf"), float("nan")])
def test_a_non_positive_or_infinite_interval_is_rejected(interval: float) -> None:
    with pytest.raises(InvalidArgument):
        Registrar(FakeCoordinator(), "node-a", heartbeat_interval_s=interval)


def test_an_empty_instance_id_is_rejected() -> None:
    with pytest.raises(InvalidArgument):
        Registrar(FakeCoordinator(), "")
