"""Helpers of the NATS transport tests: a raw JetStream client, fleet views, waits.

:class:`RawNats` is a plain nats-py connection on a test's event-loop
thread, driven synchronously: it publishes what a misbehaving (or resending)
node would, and reads the stream back to check what JetStream stored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.nats_names import DEFAULT_STREAM
from kvmesh.storage.events.jetstream import MSG_ID_HEADER
from tests.integration.coordinator.support import Clients, eventually
from tests.integration.storage.support import Node
from tests.support.harness import ServerThread
from tests.support.waiting import wait_until

Placement = tuple[bytes, int, str, int]
DEADLINE_S = 20.0


class RawNats:
    """A nats-py connection owned by ``thread``'s loop, with blocking shorthands."""

    def __init__(self, thread: ServerThread, url: str) -> None:
        self.thread = thread

        async def connect() -> NatsClient:
            return await nats.connect(url, allow_reconnect=False, connect_timeout=2)

        self.nc = thread.run(connect())

    def publish(
        self, subject: str, data: bytes, *, msg_id: str = "", stream: str = DEFAULT_STREAM
    ) -> dict[str, Any]:
        """A JetStream publish; the PubAck as a dict (``{"stream", "seq", "duplicate"?}``)."""
        headers = {"Nats-Expected-Stream": stream}
        if msg_id:
            headers[MSG_ID_HEADER] = msg_id

        async def go() -> Msg:
            return await self.nc.request(subject, data, timeout=5, headers=headers)

        reply: dict[str, Any] = json.loads(self.thread.run(go()).data)
        assert "error" not in reply, reply
        return reply

    def core_publish(self, subject: str, data: bytes) -> None:
        """A plain NATS publish (no JetStream ack), flushed."""

        async def go() -> None:
            await self.nc.publish(subject, data)
            await self.nc.flush()

        self.thread.run(go())

    def stream_state(self, stream: str = DEFAULT_STREAM) -> Any:
        """The stream's state (messages, first_seq, last_seq, ...)."""

        async def go() -> Any:
            return (await self.nc.jetstream().stream_info(stream)).state

        return self.thread.run(go())

    def stream_messages(self, stream: str = DEFAULT_STREAM) -> list[tuple[str, bytes]]:
        """Every message in the stream, oldest first: ``(subject, data)``."""

        async def go() -> list[tuple[str, bytes]]:
            js = self.nc.jetstream()
            state = (await js.stream_info(stream)).state
            out: list[tuple[str, bytes]] = []
            for seq in range(state.first_seq, state.last_seq + 1):
                msg = await js.get_msg(stream, seq)
                out.append((msg.subject or "", msg.data or b""))
            return out

        return self.thread.run(go())

    def close(self) -> None:
        """Close the connection."""
        self.thread.run(self.nc.close())


def node_placements(node: Node) -> set[Placement]:
    """What a storage node holds, as the directory should show it (ListObjects)."""
    return {
        (o.key.chunk_hash, o.tier, o.backend, o.size_bytes)
        for o in node.listing(common_pb2.TIER_ALL)
    }


def directory_of(c: Clients, instance_id: str) -> set[Placement]:
    """The coordinator's placements of ``instance_id`` (ListKeys)."""
    return {
        (k.key.chunk_hash, p.tier, p.backend, p.size_bytes)
        for k in c.list_all(instance_id=instance_id)
        for p in k.placements
    }


def batch_seqs(messages: Sequence[tuple[str, bytes]], instance_id: str) -> list[int]:
    """The seqs of ``instance_id``'s batches among stream messages, in stream order."""
    seqs: list[int] = []
    for _subject, data in messages:
        msg = events_pb2.CacheEventBatch.FromString(data)
        if msg.instance_id == instance_id:
            seqs.append(msg.seq)
    return seqs


def settled(node: Node) -> bool:
    """The node's emitter is connected and every batch it flushed is acked."""
    emitter = node.status().emitter
    return emitter.connected and emitter.unacked_batches == 0 and emitter.last_seq > 0


def wait_settled(node: Node, timeout: float = DEADLINE_S) -> int:
    """Wait until :func:`settled`; the emitter's last seq."""
    wait_until(lambda: settled(node), timeout=timeout, interval=0.02)
    return int(node.status().emitter.last_seq)


def wait_caught_up(c: Clients, node: Node, timeout: float = DEADLINE_S) -> None:
    """Wait until the node's events are acked and the coordinator's cursor reached the last."""

    def check() -> bool:
        if not settled(node):
            return False
        cursor = c.cursors().get(node.app.instance_id)
        return cursor is not None and cursor.last_seq == node.status().emitter.last_seq

    eventually(check, timeout=timeout)


def wait_true(predicate: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    """``wait_for`` with this suite's deadline."""
    wait_until(predicate, timeout=timeout, interval=0.02)
