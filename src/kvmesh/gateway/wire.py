"""``kvmesh.gateway.v1`` messages to the core's plain values and back.

Conversion only: no dispatch and no state. The servicer calls these at the
edge so the core never sees a protobuf type (a registration forwarded to
storage untouched travels through the core as an opaque object).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from google.protobuf import message as _message

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common import dtypes
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.node_types import Slot
from kvmesh.gateway.core.segments import SegmentSlot
from kvmesh.gateway.core.types import EngineSpec, PrefetchStatus, PromptRangeSpec

# -- requests ---------------------------------------------------------------------------------


def tokens(values: Iterable[int]) -> np.ndarray:
    """Token ids as the core's uint32 array."""
    # fixed32 repeated fields expose a buffer: this is a memory copy, not a loop.
    return np.array(values, dtype=np.uint32)


def prompt_range(rng: gateway_pb2.PromptRange) -> PromptRangeSpec:
    """A PromptRange as the core's range."""
    return PromptRangeSpec(
        request_id=rng.request_id,
        model_name=rng.model_name,
        world_size=rng.world_size,
        cache_salt=rng.cache_salt,
        token_ids=tokens(rng.token_ids),
        start_token=rng.start_token,
        end_token=rng.end_token,
    )


def engine_spec(
    request: gateway_pb2.RegisterKVCacheRequest | gateway_pb2.RegisterEngineContextRequest,
) -> EngineSpec:
    """The engine worker a registration describes."""
    return EngineSpec(
        request.engine_id,
        request.model_name,
        request.world_size,
        request.worker_id,
        request.layout.block_size,
    )


def memory_registration(
    request: gateway_pb2.RegisterKVCacheRequest,
) -> storage_pb2.RegisterEngineMemoryRequest:
    """What storage needs to map the engine's KV memory (a layout is required)."""
    if not request.HasField("layout"):
        raise InvalidArgument("layout is required", field="layout")
    return storage_pb2.RegisterEngineMemoryRequest(
        engine_id=request.engine_id, layout=request.layout, layers=request.layers
    )


def host_memory(request: gateway_pb2.RegisterKVCacheRequest) -> bool:
    """Whether every layer of the registration is shared (host) memory, not a GPU's."""
    return bool(request.layers) and all(
        handle.WhichOneof("kind") == "shared_memory" for handle in request.layers
    )


def layout_fingerprint(request: gateway_pb2.RegisterKVCacheRequest) -> bytes:
    """Identifies a registration's layout and memory, so a different re-register is refused."""
    messages: list[_message.Message] = [request.layout, *request.layers]
    return b"|".join(m.SerializeToString(deterministic=True) for m in messages)


def kv_format(
    layout: common_pb2.KVLayout | gateway_pb2.EngineContextLayout,
) -> tuple[int, ...]:
    """What a chunk's bytes mean under ``layout`` (dtype, planes, layers, heads, head
    dim): engines of one model must agree on it, since keys do not carry it."""
    if isinstance(layout, gateway_pb2.EngineContextLayout):
        planes = 1 if layout.use_mla else 2
    else:
        planes = 1 if layout.kind == common_pb2.KV_LAYOUT_KIND_MLA else 2
    return (layout.dtype, planes, layout.num_layers, layout.kv_heads, layout.head_dim)


def chunk_bytes(layout: common_pb2.KVLayout, chunk_size: int) -> int:
    """Bytes of one chunk object under ``layout`` (0 when the layout is incomplete)."""
    itemsize = dtypes.itemsize(layout.dtype) or 0
    planes = 1 if layout.kind == common_pb2.KV_LAYOUT_KIND_MLA else 2
    return planes * layout.num_layers * chunk_size * layout.kv_heads * layout.head_dim * itemsize


def itemsize(layout: gateway_pb2.EngineContextLayout) -> int:
    """Bytes per element of an engine context's dtype (which must be specified)."""
    size = dtypes.itemsize(layout.dtype)
    if size is None:
        raise InvalidArgument("layout.dtype must be specified", field="layout.dtype")
    return size


# -- responses --------------------------------------------------------------------------------


def prefetch_status(status: PrefetchStatus) -> gateway_pb2.PrefetchStatus:
    """The core's status as the message."""
    return gateway_pb2.PrefetchStatus(
        completed=status.completed,
        hit_chunks=status.hit_chunks,
        hit_tokens=status.hit_tokens,
        l1_hit_chunks=status.l1_hit_chunks,
        l2_hit_chunks=status.l2_hit_chunks,
        lease=gateway_pb2.Lease(
            lease_id=status.lease_id,
            ttl_ms=status.lease_ttl_ms,
            start_token=0,
            end_token=status.hit_tokens,
        )
        if status.lease_id
        else None,
    )


def chunk_slot(slot: Slot) -> gateway_pb2.ChunkSlot:
    """An L1 slot the engine maps to copy a chunk."""
    return gateway_pb2.ChunkSlot(
        chunk_index=slot.chunk_index,
        region=common_pb2.SharedMemoryHandle(
            path=slot.path, offset_bytes=slot.offset_bytes, size_bytes=slot.size_bytes
        ),
    )


def segment_region(slot: SegmentSlot) -> common_pb2.SharedMemoryHandle | None:
    """Where a CacheBlend segment's object lives (None: no slot)."""
    if not slot.transaction_id:
        return None
    return common_pb2.SharedMemoryHandle(
        path=slot.path, offset_bytes=slot.offset_bytes, size_bytes=slot.size_bytes
    )
