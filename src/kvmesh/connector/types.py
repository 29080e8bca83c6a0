"""What both halves of the connector share: roles, settings, errors and RPC helpers."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Protocol

import grpc

logger = logging.getLogger(__name__)


class KVConnectorRole(enum.Enum):
    """Which half of the connector an instance is (vLLM's ``KVConnectorRole``)."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


class ConnectorError(RuntimeError):
    """The connector cannot do what was asked (bad KV tensors, registration refused)."""


class ShmRegion(Protocol):
    """Where one layer's KV tensor lives in a shared-memory file."""

    @property
    def path(self) -> str:
        """Absolute path of the file."""
        ...

    @property
    def offset_bytes(self) -> int:
        """Start of the layer in the file."""
        ...

    @property
    def size_bytes(self) -> int:
        """Bytes of the layer."""
        ...


@dataclass(frozen=True)
class KVMeshConnectorConfig:
    """Settings of the connector (vLLM: ``kv_connector_extra_config``)."""

    #: Gateway address, ``host:port`` or ``unix:path``.
    gateway: str
    #: vLLM's ``model_config.model``: part of every cache key.
    model_name: str
    #: Tokens per paged block of the engine.
    block_size: int = 16
    world_size: int = 1
    worker_id: int = 0
    #: Unique per worker process; generated when empty.
    engine_id: str = ""
    num_kv_readers: int = 1
    #: A lookup unfinished after this long counts as a miss (LMCache: mq_timeout).
    lookup_timeout_s: float = 30.0
    #: The first Lookup waits up to this long for its result (L1 hits finish at once);
    #: 0 returns at once and the result comes from a later poll.
    lookup_wait_ms: int = 0
    #: Deadline of each RPC but the registration; None keeps the typed client's
    #: per-RPC defaults.
    rpc_timeout_s: float | None = None
    #: Deadline of RegisterKVCache; None keeps the typed client's default (30 s).
    register_timeout_s: float | None = None
    #: Threads that run the worker's retrieves and stores.
    transfer_threads: int = 2
    #: Store a prompt's chunks once its whole prefill ran (in the step that finishes it),
    #: not after every prefill step: on a small host, stores running beside the next
    #: prefill step's forward slow it down (its time to first token), while after the
    #: last step they overlap decoding. False: store after every step (LMCache's way).
    store_after_prefill: bool = False
    #: The engine instance both halves belong to (vLLM: ``kv_transfer_config.engine_id``,
    #: shared by its scheduler and workers). The scheduler's lookups carry it and its
    #: heartbeat keeps it alive, so the gateway ends their leases when the engine is
    #: gone. Empty: the scheduler's lookups have no owner (their leases end by
    #: EndSession or their TTL).
    instance_id: str = ""
    #: Seconds between two heartbeats (Ping) of each half; 0 turns them off, and the
    #: gateway then reaps an idle engine after its ``engine_reap_seconds``.
    heartbeat_s: float = 2.0
    #: Scheduler only: the engine id of the one worker whose loads it starts ahead with
    #: ``RetrieveAhead`` (docs/vllm.md, "Loads started by the scheduler"). Empty: off.
    #: Only for an engine whose KV memory is host memory, with one worker, that runs a
    #: step only after the previous one finished and loads whole (not by layer).
    ahead_engine_id: str = ""


@dataclass(frozen=True)
class LookupResult:
    """A finished lookup: cached tokens, and the chunks found in L1 / loaded from L2."""

    hit_tokens: int
    l1_hit_chunks: int
    l2_hit_chunks: int


def status_code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    """The status code of a failed call (None for an error raised outside a call)."""
    code = getattr(exc, "code", None)
    return code() if callable(code) else None


def rpc_failure(exc: grpc.RpcError) -> str:
    code = status_code(exc)
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return f"{code.name if code else 'ERROR'}: {text}"
