"""vLLM-shaped KV connector over kvmesh's gateway.

Public API: :class:`KVMeshConnector` (the hooks), :class:`KVMeshConnectorConfig`,
:class:`KVConnectorRole`, and the plain data it exchanges with an engine —
:class:`Request`, :class:`SchedulerOutput`, :class:`ConnectorMetadata`,
:class:`RetrieveOp`, :class:`StoreOp`.
"""

from kvmesh.connector.core import (
    ConnectorError,
    KVConnectorRole,
    KVMeshConnector,
    KVMeshConnectorConfig,
    LookupResult,
    ShmRegion,
)
from kvmesh.connector.metadata import (
    ConnectorMetadata,
    Request,
    RetrieveOp,
    SchedulerOutput,
    StoreOp,
)

__all__ = [
    "ConnectorError",
    "ConnectorMetadata",
    "KVConnectorRole",
    "KVMeshConnector",
    "KVMeshConnectorConfig",
    "LookupResult",
    "Request",
    "RetrieveOp",
    "SchedulerOutput",
    "ShmRegion",
    "StoreOp",
]
