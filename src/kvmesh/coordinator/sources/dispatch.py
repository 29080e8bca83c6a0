"""The core's command dispatcher (deletes, resyncs) for a fleet with gRPC and NATS nodes.

A node with an open gRPC event stream gets its commands down that stream
(it answers there); any other node gets them over NATS. Both sides are
given as protocols, so this module needs neither the gRPC services nor
nats-py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core.eviction import DeleteDispatcher
from kvmesh.coordinator.core.resync import ResyncDispatcher


class _StreamDispatcher(Protocol):
    """The gRPC side (``NodeStreams``): who has an open stream, and dispatch over it."""

    def connected(self, instance_id: str) -> bool:
        """True while ``instance_id`` has an open event stream."""
        ...

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> str | bool:
        """Send a delete down the node's stream; its id, or "" when it has none."""
        ...

    def dispatch_resync(self, instance_id: str) -> bool:
        """Send a resync down the node's stream; False when it has none."""
        ...


class _NatsDispatcher(DeleteDispatcher, ResyncDispatcher, Protocol):
    """The NATS side: deletes and resyncs over core NATS."""


class PreferStreamDispatcher:
    """The core's ``DeleteDispatcher`` and ``ResyncDispatcher`` for gRPC and NATS nodes.

    A node with an open gRPC event stream gets the command down that stream
    (it answers there); any other node gets it over NATS. Never blocks.
    """

    def __init__(self, streams: _StreamDispatcher, nats: _NatsDispatcher) -> None:
        self._streams = streams
        self._nats = nats

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> str | bool:
        """Down the gRPC stream when the node has one, else over NATS; the command's id."""
        if self._streams.connected(instance_id):
            sent = self._streams.dispatch_delete(instance_id, tier, backend, keys, force)
            if sent:
                return sent
        return self._nats.dispatch_delete(instance_id, tier, backend, keys, force)

    def dispatch_resync(self, instance_id: str) -> bool:
        """Down the gRPC stream when the node has one, else over NATS."""
        if self._streams.connected(instance_id) and self._streams.dispatch_resync(instance_id):
            return True
        return self._nats.dispatch_resync(instance_id)
