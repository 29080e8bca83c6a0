"""kvmesh's vLLM connector: ``kv_connector_module_path = "kvmesh.connector.vllm"``.

vLLM imports this package and reads ``KVMeshConnector`` off it; that first
read imports vLLM (the connector runs inside vLLM's processes). The package's
other modules (settings, the shared-memory pool, layouts) load no vLLM, and
the rest of :mod:`kvmesh.connector` does not either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.connector.vllm.connector import KVMeshConnector, KVMeshMetadata

__all__ = ["KVMeshConnector", "KVMeshMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvmesh.connector.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
