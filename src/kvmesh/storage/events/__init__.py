"""The node's cache-event pipeline: emitter, registration and the transports to the coordinator.

It sits above the storage core and implements the core's ports
(:mod:`kvmesh.storage.core.ports`); the core never imports it.

* :mod:`~kvmesh.storage.events.emitter` — batching, seq numbering, capacity
  declarations (settings and counters in :mod:`~kvmesh.storage.events.config`);
  :mod:`~kvmesh.storage.events.sink` — the core's event sink over it;
* :mod:`~kvmesh.storage.events.delivery` — the bounded window of unacked
  batches, acks, reconnects and resends;
* :mod:`~kvmesh.storage.events.transport` — the contract a transport
  implements; :mod:`~kvmesh.storage.events.codec` — its wire forms;
  :mod:`~kvmesh.storage.events.commands` — the command executor every
  transport shares;
* :mod:`~kvmesh.storage.events.grpc_transport` and
  :mod:`~kvmesh.storage.events.nats_transport` (with
  :mod:`~kvmesh.storage.events.jetstream`) — the two transports;
* :mod:`~kvmesh.storage.events.registrar` and
  :mod:`~kvmesh.storage.events.grpc_membership` — membership.
"""
