"""The contract between the cache-event emitter and the transports that carry its stream.

The emitter (:mod:`kvmesh.storage.events.emitter`) talks to the coordinator
only through an :class:`EventTransport`: it opens an :class:`EventSession`,
sends numbered batches on it, and hears back through a
:class:`SessionListener` — acks, coordinator commands (each answered with a
:class:`CommandResult`) and the stream's end. The gRPC transport
(:mod:`~kvmesh.storage.events.grpc_transport`) and the NATS JetStream transport
(:mod:`~kvmesh.storage.events.nats_transport`) implement it; the commands
themselves are the core's types (:mod:`kvmesh.storage.core.ports`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvmesh.common.errors import Unavailable
from kvmesh.common.events import CacheEventBatch, IngestResult
from kvmesh.storage.core.ports import NodeCommand

__all__ = [
    "CommandResult",
    "EventSession",
    "EventTransport",
    "SessionListener",
    "TransportError",
]


class TransportError(Unavailable):
    """The event stream could not be opened, or broke; the emitter reconnects and resends."""

    default_reason = "EVENT_TRANSPORT_UNAVAILABLE"


@dataclass(frozen=True, slots=True)
class CommandResult:
    """The node's answer to one :data:`~kvmesh.storage.core.ports.NodeCommand`, sent upstream.

    ``code`` is a ``grpc.StatusCode`` name ("OK", "INVALID_ARGUMENT",
    "UNAVAILABLE", "UNIMPLEMENTED", "INTERNAL", ...), the same names as
    :attr:`kvmesh.common.errors.KvmeshError.code`. ``affected`` counts keys
    deleted or announced. Every cache event the handler recorded before it
    returned is in a batch with ``seq <= effects_through_seq``, so the
    coordinator knows the effects are applied once its cursor for this
    emitter reaches that seq.
    """

    command_id: str
    code: str = "OK"
    message: str = ""
    affected: int = 0
    effects_through_seq: int = 0

    @property
    def ok(self) -> bool:
        """True when the command succeeded."""
        return self.code == "OK"

    @property
    def error(self) -> str:
        """``"CODE: message"`` when the command failed, else "" (the wire's error text)."""
        return "" if self.ok else f"{self.code}: {self.message}"


class SessionListener(Protocol):
    """What an :class:`EventSession` calls back into (implemented by the emitter).

    Threading contract for a session implementation:

    * ``on_ack`` is called once per batch the coordinator answered, in stream
      order, from the session's reader thread. An ack for seq N also means
      every earlier seq of this incarnation was processed (the stream is
      ordered and the gate drops ``seq <= last_seq``).
    * ``on_command`` is called for each command, one at a time in arrival
      order, on a thread that does not deliver acks (a slow delete must not
      stall acks): every transport hands commands to a
      :class:`~kvmesh.storage.events.commands.CommandExecutor`. It never
      raises; the session writes the returned :class:`CommandResult`
      upstream on the same stream (a ``oneof`` beside the batches in the
      gRPC request message).
    * ``on_closed`` is called once when the stream ends for any reason other
      than :meth:`EventSession.close` (``error`` None for a clean end).
    """

    def on_ack(self, seq: int, result: IngestResult) -> None:
        """The coordinator's gate answered the batch ``seq``."""
        ...

    def on_command(self, command: NodeCommand) -> CommandResult:
        """Execute a command sent down the stream and return its result."""
        ...

    def on_closed(self, error: BaseException | None) -> None:
        """The stream ended; the emitter will reconnect."""
        ...


class EventSession(Protocol):
    """One open event stream to the coordinator (e.g. one bidirectional gRPC call)."""

    def send(self, batch: CacheEventBatch) -> None:
        """Queue ``batch`` on the stream; quick, may block briefly for flow control.

        Only the emitter's sender thread calls it, in seq order. Raises
        :class:`TransportError` when the stream is broken. The session
        serialises this with its own writes of command results.
        """
        ...

    def close(self) -> None:
        """End the stream; idempotent, callable from any thread, unblocks a pending send."""
        ...


class EventTransport(Protocol):
    """Opens event sessions to the coordinator (the gRPC or NATS client plugs in here)."""

    def connect(
        self, instance_id: str, incarnation: int, listener: SessionListener
    ) -> EventSession:
        """Open a stream for this emitter; raise :class:`TransportError` on failure.

        ``instance_id``/``incarnation`` are sent when the stream opens (gRPC
        metadata or a first hello message) so the coordinator can route
        commands to this node before its first batch.
        """
        ...
