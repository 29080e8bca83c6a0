"""The gateway core: plain asyncio Python, no protobuf or grpc.

Import :class:`Gateway` for the composed service, the pieces (engines,
sessions, lookups, transfers) for tests and other facades, and the
:class:`NodeStorage` port and its types from ``node_storage`` to implement
the link to a storage node.
"""

from .engines import EngineRegistry, RegisteredEngine
from .gateway import Gateway
from .lookups import MAX_KV_READERS, LookupLocks
from .node_storage import KeyGridSpec, KeyRow, NodeStorage, PreparedSlots
from .sessions import LookupState, Session, SessionTable
from .transfers import Transfers
from .types import EngineSpec, GatewayStats, PrefetchStatus, PromptRangeSpec, StoreResult

__all__ = [
    "MAX_KV_READERS",
    "EngineRegistry",
    "EngineSpec",
    "Gateway",
    "GatewayStats",
    "KeyGridSpec",
    "KeyRow",
    "LookupLocks",
    "LookupState",
    "NodeStorage",
    "PrefetchStatus",
    "PreparedSlots",
    "PromptRangeSpec",
    "RegisteredEngine",
    "Session",
    "SessionTable",
    "StoreResult",
    "Transfers",
]
