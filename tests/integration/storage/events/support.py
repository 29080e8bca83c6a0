"""Test doubles for the link tests: keys, a recording listener, a node that obeys commands."""

from __future__ import annotations

import threading

from kvmesh.common.errors import KvmeshError
from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, IngestResult, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.ports import (
    DeleteKeysCommand,
    NodeCommand,
    QuotaChangedCommand,
    ResyncCommand,
)
from kvmesh.storage.events.emitter import CacheEventEmitter
from kvmesh.storage.events.transport import CommandResult

MODEL = "org/model-7b"


def key(i: int, salt: str = "") -> ObjectKey:
    """A valid key whose chunk hash encodes ``i``."""
    return ObjectKey(i.to_bytes(32, "big"), MODEL, 0x01000100, 0, salt)


def key_id(k: ObjectKey) -> int:
    """Inverse of :func:`key`."""
    return int.from_bytes(k.chunk_hash, "big")


def store_batch(seq: int, *, incarnation: int = 1, instance_id: str = "node-a") -> CacheEventBatch:
    """A one-entry STORE batch."""
    return CacheEventBatch(
        instance_id=instance_id,
        incarnation=incarnation,
        seq=seq,
        event_type=EventType.STORE,
        tier=Tier.L1,
        backend="dram",
        entries=(CacheEventEntry(key(seq), 4096, (1, 2, 3), 0),),
    )


class RecordingListener:
    """A SessionListener that records every callback (and answers commands OK)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.acks: list[tuple[int, IngestResult]] = []
        self.commands: list[NodeCommand] = []
        self.closed: list[BaseException | None] = []
        self.threads: set[str] = set()

    def on_ack(self, seq: int, result: IngestResult) -> None:
        with self._cond:
            self.acks.append((seq, result))
            self.threads.add(f"ack:{threading.current_thread().name}")
            self._cond.notify_all()

    def on_command(self, command: NodeCommand) -> CommandResult:
        with self._cond:
            self.commands.append(command)
            self.threads.add(f"command:{threading.current_thread().name}")
            self._cond.notify_all()
        return CommandResult(command_id=command.command_id, affected=len(self.commands))

    def on_closed(self, error: BaseException | None) -> None:
        with self._cond:
            self.closed.append(error)
            self._cond.notify_all()

    def wait(self, predicate: object, timeout: float = 10.0) -> None:
        """Block until ``predicate()`` holds; AssertionError after ``timeout``."""
        assert callable(predicate)
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise AssertionError(f"listener condition not met within {timeout} s")


class FakeNode:
    """A storage node's L2 index that obeys coordinator commands and reports through the emitter."""

    def __init__(self) -> None:
        self.emitter: CacheEventEmitter | None = None
        self.l2: dict[ObjectKey, int] = {}
        self.quotas: dict[tuple[str, Tier], int | None] = {}
        self.fail_with: KvmeshError | None = None
        self.handled: list[NodeCommand] = []

    def handle_command(self, command: NodeCommand) -> int:
        assert self.emitter is not None
        self.handled.append(command)
        if self.fail_with is not None:
            raise self.fail_with
        if isinstance(command, DeleteKeysCommand):
            gone = [k for k in command.keys if self.l2.pop(k, None) is not None]
            self.emitter.record(
                EventType.DELETE, command.tier, "fs", False, [CacheEventEntry(k) for k in gone]
            )
            return len(gone)
        if isinstance(command, ResyncCommand):
            entries = [CacheEventEntry(k, size) for k, size in self.l2.items()]
            self.emitter.record(EventType.STORE, Tier.L2, "fs", False, entries)
            return len(entries)
        assert isinstance(command, QuotaChangedCommand)
        self.quotas[(command.cache_salt, command.tier)] = command.quota_bytes
        return 0
