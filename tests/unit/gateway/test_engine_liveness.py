"""Engines are alive or gone: a silent engine is reaped, a silent scheduler's leases end.

The gateway core against its in-memory storage fake and a hand-driven clock
(the reap itself is the sweep's; the real-vLLM test kills an engine and sees
its memory come back).
"""

from __future__ import annotations

from tests.unit.gateway.test_gateway_core import FakeStorage, make, register, run


def test_an_engine_silent_for_the_reap_time_is_unmapped_whether_or_not_it_ever_pinged() -> None:
    gw, storage, clock = make(engine_reap_s=15.0)
    register(gw, "quiet")
    register(gw, "beating")
    clock.now += 10
    assert gw.ping("beating")
    clock.now += 10
    run(gw.sweep())
    assert gw.engine_ids() == ["beating"]
    assert "quiet" not in storage.engines
    assert gw.stats()["engines_reaped"] == 1


def test_every_call_of_an_engine_counts_as_a_sign_of_life() -> None:
    gw, _storage, clock = make(engine_reap_s=15.0)
    register(gw, "e0")
    for _ in range(4):
        clock.now += 10
        assert gw.engines.get("e0", engine_driven=False)  # what every data-path call does
        run(gw.sweep())
    assert gw.engine_ids() == ["e0"]


def test_a_reaped_engine_that_comes_back_registers_again_and_is_counted() -> None:
    gw, _storage, clock = make(engine_reap_s=15.0)
    register(gw, "e0")
    clock.now += 16
    run(gw.sweep())
    assert not gw.ping("e0")  # what the connector's heartbeat reads: register again
    register(gw, "e0")
    assert gw.engine_ids() == ["e0"]
    assert gw.stats()["reregistrations"] == 1


def test_a_silent_owner_is_handed_to_the_gateway_once_and_forgotten() -> None:
    gw, _storage, clock = make(engine_reap_s=15.0)
    gone: list[str] = []

    async def owner_gone(owner: str) -> int:
        gone.append(owner)
        return 2

    gw.engines.on_owner_gone = owner_gone
    assert not gw.ping("instance-a")  # a scheduler's heartbeat: no engine of that id
    assert not gw.ping("instance-b")
    clock.now += 10
    gw.ping("instance-b")
    assert gw.stats()["live_owners"] == 2
    clock.now += 10
    run(gw.sweep())
    assert gone == ["instance-a"]
    clock.now += 20
    run(gw.sweep())
    run(gw.sweep())
    assert gone == ["instance-a", "instance-b"]
    assert gw.stats()["owners_reaped"] == 2
    assert gw.stats()["live_owners"] == 0


def test_reaping_off_keeps_every_engine() -> None:
    gw, _storage, clock = make(engine_reap_s=0.0)
    register(gw, "e0")
    clock.now += 10_000
    run(gw.sweep())
    assert gw.engine_ids() == ["e0"]


class _FlakyStorage(FakeStorage):
    """Storage whose unmapping fails while ``down`` is set."""

    down = False

    async def unregister_engine(self, engine_id: str) -> bool:
        if self.down:
            raise ConnectionError("storage is restarting")
        return await super().unregister_engine(engine_id)


def test_an_engine_whose_unmapping_failed_is_unmapped_by_a_later_sweep() -> None:
    storage = _FlakyStorage()
    gw, _, clock = make(storage, engine_reap_s=15.0)
    register(gw, "gone")
    register(gw, "back")
    storage.down = True
    clock.now += 16
    run(gw.sweep())  # both reaped; storage could not unmap them
    assert gw.engine_ids() == []
    assert set(storage.engines) == {"gone", "back"}
    run(gw.sweep())
    assert set(storage.engines) == {"gone", "back"}  # still down: owed, not forgotten
    register(gw, "back")  # its worker registers again: its memory is in use
    storage.down = False
    run(gw.sweep())
    assert set(storage.engines) == {"back"}
    assert gw.engine_ids() == ["back"]
