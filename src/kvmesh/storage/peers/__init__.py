"""P2P over the wire: the PeerService servicer, and the gRPC links the P2P core uses.

- :mod:`~kvmesh.storage.peers.servicer`: ``kvmesh.storage.v1.PeerService``
  over :class:`~kvmesh.storage.core.peer.leases.PeerLeases`.
- :mod:`~kvmesh.storage.peers.links`: the coordinator's directory and
  membership (through ``kvmesh.coordinator.client``) and other nodes'
  PeerService (through ``kvmesh.storage.peer_client``), as the ports of
  :mod:`kvmesh.storage.core.peer.ports`.
"""
