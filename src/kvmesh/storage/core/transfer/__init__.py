"""Engines' KV memory: its layout, opening its handles, and the copies to and from L1.

* :mod:`~kvmesh.storage.core.transfer.layout` — the KV layout an engine
  registers and the geometry of its L1 chunk objects;
* :mod:`~kvmesh.storage.core.transfer.shm` and
  :mod:`~kvmesh.storage.core.transfer.cuda_ipc` — the two kinds of memory
  handle, and how each is checked and opened;
* :mod:`~kvmesh.storage.core.transfer.engine` — the transfer engine: the
  registry of engines' memory and the gathers and scatters over it.
"""
