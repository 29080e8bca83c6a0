"""kvmesh's vLLM connector: ``kv_connector_module_path = "kvmesh.connector.vllm"``.

Importing this package imports vLLM (it runs inside vLLM's processes); the
rest of :mod:`kvmesh.connector` does not.
"""

from kvmesh.connector.vllm.connector import KVMeshConnector, KVMeshMetadata

__all__ = ["KVMeshConnector", "KVMeshMetadata"]
