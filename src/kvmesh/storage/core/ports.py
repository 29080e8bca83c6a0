"""The storage core's ports: what it reports outwards and the commands it accepts.

The core depends on these types only; the event pipeline
(:mod:`kvmesh.storage.events`) sits above the core and implements them — an
:class:`EventSink` adapter feeds the cache-event emitter, and the emitter
hands :data:`NodeCommand` values that came down its stream to a
:class:`CommandHandler` (the storage node). Keeping them in this leaf module
lets the manager, its controllers and the node share them without importing
each other or the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from kvmesh.common.events import EventType, Tier
from kvmesh.common.keys import ObjectKey

__all__ = [
    "CapacityModule",
    "CommandHandler",
    "DeleteKeysCommand",
    "EventSink",
    "NodeCommand",
    "QuotaChangedCommand",
    "ResyncCommand",
]

# --------------------------------------------------------------------------------------
# Outbound: placement changes
# --------------------------------------------------------------------------------------


class CapacityModule(NamedTuple):
    """One storage compartment's declared capacity (0 = undeclared)."""

    tier: Tier
    backend: str
    capacity_bytes: int
    shared: bool = False


class EventSink(Protocol):
    """Receives placement changes in order; the cache-event emitter batches and sequences them.

    Called from many threads, sometimes under the L1 lock: implementations
    must be thread-safe, quick (append to a buffer) and must never call back
    into the storage manager.
    """

    def record(
        self,
        event_type: EventType,
        tier: Tier,
        backend: str,
        shared: bool,
        entries: Sequence[tuple[ObjectKey, int]],
    ) -> None:
        """Record one run of same-kind changes; entries are ``(key, size_bytes)``.

        ``size_bytes`` is meaningful for STORE only (0 otherwise). ACCESS on
        L1 uses backend ``""``, as in LMCache.
        """
        ...

    def record_capacity(self, modules: Sequence[CapacityModule]) -> None:
        """Declare the node's whole storage topology (replaces any earlier declaration)."""
        ...


# --------------------------------------------------------------------------------------
# Inbound: coordinator commands
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeleteKeysCommand:
    """Delete these keys from one tier of this node (``backend`` "" = every adapter of it).

    Sent by the coordinator's fleet eviction controller (and operator deletes).
    The node answers with DELETE cache events for what it actually removed;
    keys it does not hold are not an error. ``force`` mirrors the contract's
    field of that name (delete even what the node would otherwise keep).
    """

    command_id: str
    tier: Tier
    backend: str
    keys: tuple[ObjectKey, ...]
    force: bool = False


@dataclass(frozen=True, slots=True)
class QuotaChangedCommand:
    """A per-``cache_salt`` byte quota for one tier changed (``quota_bytes`` None = removed).

    0 is a real quota: the salt may keep nothing on that tier.
    """

    command_id: str
    cache_salt: str
    tier: Tier
    quota_bytes: int | None


@dataclass(frozen=True, slots=True)
class ResyncCommand:
    """Re-announce every placement this node holds in ``tier`` as STORE events.

    Sent after a coordinator cold start (or a gap it cannot replay) so the
    directory learns the placements it lost — typically the L2 index, whose
    bytes outlive both processes.
    """

    command_id: str
    tier: Tier = Tier.L2


NodeCommand = DeleteKeysCommand | QuotaChangedCommand | ResyncCommand
"""A command the coordinator sends down a node's event stream."""


@runtime_checkable
class CommandHandler(Protocol):
    """The storage node's side of coordinator commands.

    Called by the event pipeline (off the ack path, one command at a time,
    in arrival order); may block for a bounded time. Returns how many
    keys it affected; raises a :class:`KvmeshError` to report a failure with
    that error's status code. Effects are reported by recording cache events
    on the emitter, not in the return value.
    """

    def handle_command(self, command: NodeCommand) -> int:
        """Carry out ``command``; return the number of keys affected."""
        ...
