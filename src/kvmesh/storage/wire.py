"""Protobuf to the storage core's types and back, for ``StorageService`` (and the
in-process link of ``kvmesh node``, which registers engines the same way).

A malformed field raises :class:`~kvmesh.common.errors.InvalidArgument` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.common.convert import key_from_proto
from kvmesh.common.dtypes import torch_dtype
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import Tier
from kvmesh.common.keys import CHUNK_HASH_BYTES, ObjectKey
from kvmesh.common.node_types import PrefetchState, Slot
from kvmesh.kernels.rope_params import RopeParams, RopeStyle
from kvmesh.storage.core.transfer.cuda_ipc import CudaIpcHandle
from kvmesh.storage.core.transfer.engine import KVHandle
from kvmesh.storage.core.transfer.layout import KVLayout
from kvmesh.storage.core.transfer.shm import SharedMemoryHandle

LAYOUT_KINDS = {
    common_pb2.KV_LAYOUT_KIND_FLASH_ATTN: "flash_attn",
    common_pb2.KV_LAYOUT_KIND_FLASHINFER: "flashinfer",
    common_pb2.KV_LAYOUT_KIND_MLA: "mla",
    common_pb2.KV_LAYOUT_KIND_VLLM_CPU: "vllm_cpu",
    common_pb2.KV_LAYOUT_KIND_VLLM_CPU_AMX: "vllm_cpu_amx",
}


def layout_from_proto(layout: common_pb2.KVLayout) -> KVLayout:
    """A KVLayout, or InvalidArgument naming the bad field."""
    kind = LAYOUT_KINDS.get(layout.kind)
    if kind is None:
        raise InvalidArgument("layout.kind must be specified", field="layout.kind")
    dtype = torch_dtype(layout.dtype)
    if dtype is None:
        raise InvalidArgument("layout.dtype must be specified", field="layout.dtype")
    return KVLayout(
        kind,
        layout.num_layers,
        layout.num_blocks,
        layout.block_size,
        layout.kv_heads,
        layout.head_dim,
        dtype,
        rope=rope_from_proto(layout) if layout.HasField("rope") else None,
    )


ROPE_STYLES = {
    common_pb2.ROPE_STYLE_UNSPECIFIED: RopeStyle.NEOX,
    common_pb2.ROPE_STYLE_NEOX: RopeStyle.NEOX,
    common_pb2.ROPE_STYLE_GPTJ: RopeStyle.GPTJ,
}


def rope_from_proto(layout: common_pb2.KVLayout) -> RopeParams:
    """The layout's RoPE parameters, or InvalidArgument naming ``layout.rope``."""
    style = ROPE_STYLES.get(layout.rope.style)
    if style is None:
        raise InvalidArgument(f"unknown layout.rope.style {layout.rope.style}", field="layout.rope")
    try:
        return RopeParams(
            head_dim=layout.head_dim,
            base=layout.rope.base,
            rotary_dim=layout.rope.rotary_dim or None,
            style=style,
        )
    except ValueError as exc:
        raise InvalidArgument(f"layout.rope: {exc}", field="layout.rope") from None


def handle_from_proto(handle: common_pb2.MemoryHandle, index: int) -> KVHandle:
    """One layer's handle, or InvalidArgument when neither kind is set."""
    which = handle.WhichOneof("kind")
    if which == "shared_memory":
        shm = handle.shared_memory
        return SharedMemoryHandle(shm.path, shm.offset_bytes, shm.size_bytes)
    if which == "cuda_ipc":
        ipc = handle.cuda_ipc
        return CudaIpcHandle(
            device_index=-1,
            ipc_handle=ipc.memory_handle,
            storage_size_bytes=ipc.storage_size_bytes,
            storage_offset_bytes=ipc.storage_offset_bytes,
            ref_counter_handle=ipc.ref_counter_handle,
            ref_counter_offset=ipc.ref_counter_offset,
            event_handle=ipc.event_handle,
            event_sync_required=ipc.event_sync_required,
            shape=tuple(ipc.shape),
            stride=tuple(ipc.stride),
            tensor_offset=ipc.storage_offset_elements,
            device_uuid=ipc.device_uuid,
        )
    raise InvalidArgument(f"layers[{index}] sets no memory handle", field=f"layers[{index}]")


def checked_hashes(values: Sequence[bytes], field: str) -> list[bytes]:
    out = list(values)
    for i, h in enumerate(out):
        if len(h) != CHUNK_HASH_BYTES:
            raise InvalidArgument(
                f"{field}[{i}] must be {CHUNK_HASH_BYTES} bytes, got {len(h)}", field=field
            )
    return out


def row_keys(row: common_pb2.ChunkKeys, field: str = "keys") -> list[ObjectKey]:
    """The keys of a ChunkKeys row."""
    hashes = checked_hashes(row.chunk_hashes, f"{field}.chunk_hashes")
    return [
        ObjectKey(h, row.model_name, row.kv_rank, row.object_group_id, row.cache_salt)
        for h in hashes
    ]


def grid_rows(grid: common_pb2.KeyGrid, field: str = "keys") -> list[list[ObjectKey]]:
    """The keys of a KeyGrid, one row per kv rank."""
    hashes = checked_hashes(grid.chunk_hashes, f"{field}.chunk_hashes")
    return [
        [ObjectKey(h, grid.model_name, rank, grid.object_group_id, grid.cache_salt) for h in hashes]
        for rank in grid.kv_ranks
    ]


def segment_placement(
    segment: storage_pb2.SegmentPlacement,
) -> tuple[str, ObjectKey, list[int], int, int]:
    """A SegmentPlacement's (engine_id, key, block_ids, start_token, num_tokens)."""
    if not segment.HasField("key"):
        raise InvalidArgument("segment.key must be set", field="segment.key")
    return (segment.engine_id, key_from_proto(segment.key), list(segment.block_ids),
            segment.start_token, segment.num_tokens)  # fmt: skip


def tier_of(value: int, *, allow_all: bool) -> Tier | None:
    if value == common_pb2.TIER_L1:
        return Tier.L1
    if value == common_pb2.TIER_L2:
        return Tier.L2
    if value == common_pb2.TIER_ALL and allow_all:
        return None
    allowed = "TIER_L1, TIER_L2 or TIER_ALL" if allow_all else "TIER_L1 or TIER_L2"
    raise InvalidArgument(f"tier must be {allowed}", field="tier")


def prefetch_result(status: PrefetchState) -> tuple[bool, storage_pb2.PrefetchResult]:
    return status.completed, storage_pb2.PrefetchResult(
        hit_chunks=status.hit_chunks,
        l1_hit_chunks=status.l1_hit_chunks,
        l2_hit_chunks=status.l2_hit_chunks,
        lease_ttl_ms=status.lease_ttl_ms,
    )


def slot_to_proto(slot: Slot) -> storage_pb2.Slot:
    return storage_pb2.Slot(
        chunk_index=slot.chunk_index,
        region=common_pb2.SharedMemoryHandle(
            path=slot.path, offset_bytes=slot.offset_bytes, size_bytes=slot.size_bytes
        ),
    )
