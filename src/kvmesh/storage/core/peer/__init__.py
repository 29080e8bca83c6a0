"""Node to node (P2P): fetch a prefix another node holds, and serve ours to peers.

- :mod:`~kvmesh.storage.core.peer.ports`: what the P2P core needs from the
  outside (the coordinator's directory, a link to a peer), as protocols; the
  gRPC implementations live in :mod:`kvmesh.storage.peers`.
- :mod:`~kvmesh.storage.core.peer.fetch`: the asking side (on a local miss).
- :mod:`~kvmesh.storage.core.peer.leases`: the serving side (read-locked
  prefixes with a TTL, streamed in bounded frames).
"""
