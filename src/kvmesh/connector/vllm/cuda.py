"""vLLM's KV cache on a GPU: CUDA IPC handles for storage, and the events that order copies.

The storage node opens each layer's tensor from its CUDA IPC handle (torch's
storage sharing: the allocation, the tensor's place in it, the device by
UUID) and copies blocks on its own stream. Ordering against vLLM's stream
uses interprocess CUDA events: before a load and after a forward the worker
records one on vLLM's current stream and sends its IPC handle with the
request; storage's copies wait for it on the device, and storage answers
only when its copies are done, so the blocks are ready when the RPC returns.

Runs only where CUDA is present (the tests that exercise it skip without a
device). Layer layouts vLLM uses on GPUs: FlashAttention
``[2, num_blocks, block_size, kv_heads, head_dim]``, FlashInfer
``[num_blocks, 2, block_size, kv_heads, head_dim]``, MLA
``[num_blocks, block_size, head_dim]``; a layout in another stride order (vLLM's
HND) is not contiguous and keeps kvmesh off.
"""

from __future__ import annotations

import logging
from typing import Any, TypedDict

import torch

from kvmesh.api.common.v1 import common_pb2

logger = logging.getLogger(__name__)


def gpu_layout_kind(
    first: torch.Tensor, *, block_size: int
) -> tuple[common_pb2.KVLayoutKind.ValueType, str | None]:
    """The kvmesh layout of one of vLLM's GPU KV tensors, or why kvmesh cannot move it."""
    shape = tuple(first.shape)
    unspecified = common_pb2.KV_LAYOUT_KIND_UNSPECIFIED
    if not first.is_contiguous():
        return unspecified, f"KV tensor of shape {shape} is not contiguous (HND stride order?)"
    if len(shape) == 3 and shape[1] == block_size:
        return common_pb2.KV_LAYOUT_KIND_MLA, None
    if len(shape) == 5 and shape[2] == block_size:
        if shape[0] == 2 and shape[1] != 2:
            return common_pb2.KV_LAYOUT_KIND_FLASH_ATTN, None
        if shape[1] == 2 and shape[0] != 2:
            return common_pb2.KV_LAYOUT_KIND_FLASHINFER, None
    return unspecified, f"KV tensor shape {shape} is no layout kvmesh moves"


class LayoutFields(TypedDict):
    """The geometry fields of a ``KVLayout`` that a KV tensor's shape gives."""

    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int


def layout_fields(kind: common_pb2.KVLayoutKind.ValueType, shape: tuple[int, ...]) -> LayoutFields:
    """``num_blocks``, ``block_size``, ``kv_heads``, ``head_dim`` of a GPU KV tensor's shape."""
    if kind == common_pb2.KV_LAYOUT_KIND_MLA:
        return {"num_blocks": shape[0], "block_size": shape[1], "kv_heads": 1, "head_dim": shape[2]}
    blocks = shape[1] if kind == common_pb2.KV_LAYOUT_KIND_FLASH_ATTN else shape[0]
    return {
        "num_blocks": blocks,
        "block_size": shape[2],
        "kv_heads": shape[3],
        "head_dim": shape[4],
    }


def ipc_handle(tensor: torch.Tensor) -> common_pb2.MemoryHandle:
    """One layer's CUDA IPC handle (vLLM keeps the tensor alive while it is registered)."""
    fields: Any = tensor.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
    return common_pb2.MemoryHandle(
        cuda_ipc=common_pb2.CudaIpcHandle(
            device_uuid=str(torch.cuda.get_device_properties(int(device)).uuid),
            memory_handle=bytes(handle),
            storage_size_bytes=int(size),
            storage_offset_bytes=int(offset),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle) if event_handle else b"",
            event_sync_required=bool(event_sync),
            shape=list(tensor.shape),
            stride=list(tensor.stride()),
            storage_offset_elements=int(tensor.storage_offset()),
        )
    )


class StreamEvents:
    """Interprocess events on vLLM's current stream, kept alive until their copies finish."""

    #: Events kept for copies that may still be waiting on them (oldest dropped first).
    KEEP = 64

    def __init__(self) -> None:
        self._alive: list[torch.cuda.Event] = []

    def record(self) -> bytes:
        """Record an event after the work queued so far; its 64-byte IPC handle."""
        event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream())
        self._alive.append(event)
        del self._alive[: -self.KEEP]
        handle: bytes = event.ipc_handle()  # type: ignore[no-untyped-call]
        return handle
