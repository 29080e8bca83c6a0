"""The command executor every transport shares: order, one worker on demand, shutdown."""

from __future__ import annotations

import threading

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.events import IngestResult
from kvmesh.storage.core.ports import NodeCommand, ResyncCommand
from kvmesh.storage.events.commands import CommandExecutor
from kvmesh.storage.events.transport import CommandResult
from tests.support.waiting import wait_until
from tests.unit.storage.events.fakes import DEADLINE_S

WORKER = "test-commands"


def resync(command_id: str) -> ingest_pb2.NodeCommand:
    return ingest_pb2.NodeCommand(
        command_id=command_id, resync=ingest_pb2.ResyncCommand(tier=common_pb2.TIER_L2)
    )


def workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WORKER]


class GatedListener:
    """Runs commands only while ``gate`` is open; records each on_command's thread."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.commands: list[NodeCommand] = []
        self.threads: list[str] = []

    def on_ack(self, seq: int, result: IngestResult) -> None:
        raise AssertionError("no acks here")

    def on_command(self, command: NodeCommand) -> CommandResult:
        self.started.set()
        assert self.gate.wait(DEADLINE_S)
        self.commands.append(command)
        self.threads.append(threading.current_thread().name)
        if command.command_id == "boom":
            raise RuntimeError("listener bug")
        return CommandResult(command_id=command.command_id, affected=len(self.commands))

    def on_closed(self, error: BaseException | None) -> None:
        raise AssertionError("no stream here")


def test_commands_run_in_order_on_one_worker_that_exists_only_while_busy() -> None:
    listener = GatedListener()
    replies: list[CommandResult] = []
    executor = CommandExecutor(listener, replies.append, name=WORKER)
    assert workers_alive() == []  # idle: no thread at all

    listener.gate.clear()
    for i in range(5):
        assert executor.submit(resync(f"c-{i}"))
    assert listener.started.wait(DEADLINE_S)
    assert len(workers_alive()) == 1
    listener.gate.set()

    assert wait_until(lambda: len(replies) == 5)
    assert [r.command_id for r in replies] == [f"c-{i}" for i in range(5)]
    assert [r.affected for r in replies] == [1, 2, 3, 4, 5]
    assert listener.commands == [ResyncCommand(f"c-{i}") for i in range(5)]
    assert set(listener.threads) == {WORKER}
    assert executor.join(DEADLINE_S)
    assert workers_alive() == []

    # Work after an idle spell starts a worker again.
    assert executor.submit(resync("again"))
    assert wait_until(lambda: len(replies) == 6)
    assert executor.join(DEADLINE_S)


def test_unconvertible_commands_and_failing_listeners_are_still_answered() -> None:
    listener = GatedListener()
    replies: list[CommandResult] = []
    executor = CommandExecutor(listener, replies.append, name=WORKER)

    executor.submit(ingest_pb2.NodeCommand(command_id="from-the-future"))
    executor.submit(resync("boom"))
    executor.submit(resync("after"))

    assert wait_until(lambda: len(replies) == 3)
    assert [(r.command_id, r.code) for r in replies] == [
        ("from-the-future", "UNIMPLEMENTED"),
        ("boom", "INTERNAL"),
        ("after", "OK"),
    ]
    assert "listener bug" in replies[1].message
    assert executor.join(DEADLINE_S)


def test_a_reply_that_raises_does_not_stop_the_queue() -> None:
    listener = GatedListener()
    sent: list[str] = []

    def reply(result: CommandResult) -> None:
        sent.append(result.command_id)
        if result.command_id == "first":
            raise RuntimeError("stream gone")

    executor = CommandExecutor(listener, reply, name=WORKER)
    executor.submit(resync("first"))
    executor.submit(resync("second"))

    assert wait_until(lambda: sent == ["first", "second"])
    assert executor.join(DEADLINE_S)


def test_close_drops_queued_commands_lets_the_running_one_finish_and_refuses_more() -> None:
    listener = GatedListener()
    replies: list[CommandResult] = []
    executor = CommandExecutor(listener, replies.append, name=WORKER)
    listener.gate.clear()
    executor.submit(resync("running"))
    assert listener.started.wait(DEADLINE_S)
    executor.submit(resync("queued"))

    executor.close()
    executor.close()
    assert not executor.submit(resync("late"))
    listener.gate.set()

    assert executor.join(DEADLINE_S)
    assert [r.command_id for r in replies] == ["running"]
    assert [c.command_id for c in listener.commands] == ["running"]
    assert workers_alive() == []
