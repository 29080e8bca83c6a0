"""The copy half of the transfer engine: chunk buffers checked and viewed, memory opened.

Everything here works on torch tensors, so it loads torch: the
:class:`~kvmesh.storage.core.transfer.engine.TransferEngine` imports this
module at the first registration, and a storage node with no engine
registered runs without torch.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from kvmesh.common.errors import FailedPrecondition, InvalidArgument
from kvmesh.kernels import BlockIds, PagedKVCache, blocks_for_tokens
from kvmesh.kernels import gather_chunks as gather_into
from kvmesh.kernels import scatter_chunks as scatter_from
from kvmesh.kernels import segments as segment_ops
from kvmesh.kernels.layer_range import select_layers
from kvmesh.kernels.rope_params import RopeParams
from kvmesh.storage.core.transfer.cuda_ipc import CudaIpcHandle, open_cuda_ipc
from kvmesh.storage.core.transfer.layout import (
    KVLayout,
    check_num_tokens,
    chunk_nbytes,
    chunk_shape,
)
from kvmesh.storage.core.transfer.shm import (
    SharedMemoryHandle,
    SharedMemoryOpener,
    tensor_over,
)

#: A chunk buffer: a tensor of the layout's dtype (chunk-shaped or flat), a
#: flat uint8 tensor of the chunk's bytes, or any C-contiguous buffer-protocol
#: object (bytearray, memoryview, mmap, numpy array) of exactly those bytes.
ChunkBuffer: TypeAlias = torch.Tensor | bytearray | memoryview | mmap.mmap | np.ndarray[Any, Any]
#: A scatter source: any :data:`ChunkBuffer`, or read-only ``bytes``.
ChunkSource: TypeAlias = ChunkBuffer | bytes


def open_memory(
    shm: SharedMemoryOpener,
    layout: KVLayout,
    handles: tuple[SharedMemoryHandle | CudaIpcHandle, ...],
) -> tuple[PagedKVCache, list[mmap.mmap]]:
    """Open one handle per layer (all shared memory or all CUDA IPC) as a paged KV cache."""
    if all(isinstance(h, SharedMemoryHandle) for h in handles):
        layers, mappings = shm.open(layout, handles)  # type: ignore[arg-type]
    elif all(isinstance(h, CudaIpcHandle) for h in handles):
        layers, mappings = open_cuda_ipc(layout, handles), []  # type: ignore[arg-type]
    else:
        raise InvalidArgument(
            "handles must all be SharedMemoryHandle or all CudaIpcHandle", field="handles"
        )
    return PagedKVCache(layers, layout.kind), mappings


def gather(
    kv: PagedKVCache,
    layout: KVLayout,
    block_ids: Sequence[BlockIds] | BlockIds,
    num_tokens: Sequence[int],
    outs: Sequence[ChunkBuffer],
    producer_event: bytes,
) -> None:
    """Check the arguments (naming the field, before any copy), then copy blocks into ``outs``."""
    ids, chunks = _checked(layout, block_ids, num_tokens, outs, "outs", writable=True)
    _wait_for_producer(kv, producer_event)
    gather_into(kv, ids, chunks)
    _wait_for_device(kv)


def scatter(
    kv: PagedKVCache,
    layout: KVLayout,
    block_ids: Sequence[BlockIds] | BlockIds,
    num_tokens: Sequence[int],
    srcs: Sequence[ChunkSource],
    skip_first_n_tokens: int,
    producer_event: bytes,
    layers: tuple[int, int] | None = None,
) -> None:
    """Check the arguments, then copy ``srcs`` into the blocks (retrieve direction);
    only layers ``[start, end)`` when ``layers`` is given."""
    ids, chunks = _checked(layout, block_ids, num_tokens, srcs, "srcs", writable=False)
    if layers is not None:
        kv, chunks = select_layers(kv, chunks, *layers)
    _wait_for_producer(kv, producer_event)
    scatter_from(kv, ids, chunks, skip_first_n_tokens=skip_first_n_tokens)
    _wait_for_device(kv)


def gather_segment(
    kv: PagedKVCache,
    layout: KVLayout,
    block_table: Sequence[int],
    start_token: int,
    num_tokens: int,
    out: ChunkBuffer,
) -> None:
    """Copy tokens ``[start_token, +num_tokens)`` into ``out`` with the keys moved to 0..
    (see :func:`kvmesh.kernels.segments.gather_segment`)."""
    rope = _segment_rope(layout)
    chunk = _as_chunk(out, layout, num_tokens, "out", writable=True)
    segment_ops.gather_segment(kv, block_table, chunk, start_token, rope)
    _wait_for_device(kv)


def scatter_segment(
    kv: PagedKVCache,
    layout: KVLayout,
    block_table: Sequence[int],
    start_token: int,
    num_tokens: int,
    src: ChunkSource,
) -> None:
    """Copy a segment object into tokens ``[start_token, +num_tokens)``, keys moved there
    (see :func:`kvmesh.kernels.segments.scatter_segment`)."""
    rope = _segment_rope(layout)
    chunk = _as_chunk(src, layout, num_tokens, "src", writable=False)
    segment_ops.scatter_segment(kv, block_table, chunk, start_token, rope)
    _wait_for_device(kv)


def _segment_rope(layout: KVLayout) -> RopeParams:
    if layout.rope is None:
        raise FailedPrecondition(
            "the engine registered its KV without RoPE parameters (layout.rope): its "
            "keys cannot be moved to another position",
            reason="NO_ROPE_PARAMETERS",
        )
    return layout.rope


def _checked(
    layout: KVLayout,
    block_ids: Sequence[BlockIds] | BlockIds,
    num_tokens: Sequence[int],
    buffers: Sequence[ChunkSource],
    field_name: str,
    *,
    writable: bool,
) -> tuple[list[BlockIds], list[torch.Tensor]]:
    """One block-id list and one chunk-shaped tensor per buffer (InvalidArgument otherwise)."""
    _check_buffer_list(buffers, field_name)
    ids, tokens = _per_chunk_ids(block_ids, num_tokens, len(buffers), layout)
    # A batch's chunks have one or two token counts: their shapes are worked out once.
    sizes = {n: (chunk_shape(layout, n), chunk_nbytes(layout, n)) for n in set(tokens)}
    chunks = [
        _as_chunk(buf, layout, n, f"{field_name}[{i}]", writable=writable, size=sizes[n])
        for i, (buf, n) in enumerate(zip(buffers, tokens, strict=True))
    ]
    return ids, chunks


#: Bytes of a ``cudaIpcEventHandle_t``.
CUDA_IPC_EVENT_BYTES = 64


def _wait_for_producer(kv: PagedKVCache, handle: bytes) -> None:
    """Order this process's copies after the engine's event.

    See docs/kernels.md, "Device ordering on CUDA".

    The engine records an interprocess event on its stream after the forward
    that wrote (or last read) the blocks and sends its IPC handle; the copy
    stream waits for it on the device, so neither side blocks a CPU thread on
    the other's work.
    """
    if not handle:
        return
    if kv.device.type != "cuda":
        raise InvalidArgument(
            "producer_event_handle is for KV memory on a CUDA device; this engine's KV cache "
            "is in shared memory (send none)",
            field="producer_event_handle",
        )
    if len(handle) != CUDA_IPC_EVENT_BYTES:
        raise InvalidArgument(
            f"producer_event_handle must be a {CUDA_IPC_EVENT_BYTES}-byte cudaIpcEventHandle_t, "
            f"got {len(handle)} bytes",
            field="producer_event_handle",
        )
    try:
        event = torch.cuda.Event.from_ipc_handle(kv.device, handle)  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        raise InvalidArgument(
            f"producer_event_handle does not open as a CUDA IPC event: {exc}",
            field="producer_event_handle",
        ) from None
    torch.cuda.current_stream(kv.device).wait_event(event)


def _wait_for_device(kv: PagedKVCache) -> None:
    """Return only when the copies are done: the engine reads (or frees) the memory next.

    CUDA ops are stream-ordered and return early. The reply is sent after the
    copies finished on the device, so an engine may use its blocks as soon as
    the RPC returns and needs no completion event (``completion_event_handle``
    stays empty).
    """
    if kv.device.type == "cuda":
        torch.cuda.synchronize(kv.device)


def _check_buffer_list(buffers: object, field_name: str) -> None:
    if isinstance(buffers, (str, bytes, bytearray, torch.Tensor)) or not isinstance(
        buffers, Sequence
    ):
        raise InvalidArgument(
            f"{field_name} must be a sequence of chunk buffers, one per chunk", field=field_name
        )


def _per_chunk_ids(
    block_ids: Sequence[BlockIds] | BlockIds,
    num_tokens: Sequence[int],
    num_buffers: int,
    layout: KVLayout,
) -> tuple[list[BlockIds], list[int]]:
    """Normalize the flat or per-chunk block-id forms into one id list per chunk."""
    if isinstance(num_tokens, (str, bytes)) or not isinstance(num_tokens, Sequence):
        raise InvalidArgument("num_tokens must be a sequence of ints", field="num_tokens")
    tokens = [check_num_tokens(n, f"num_tokens[{i}]") for i, n in enumerate(num_tokens)]
    if len(tokens) != num_buffers:
        raise InvalidArgument(
            f"num_tokens has {len(tokens)} entries for {num_buffers} chunk buffers",
            field="num_tokens",
        )
    flat: list[int] | None = None
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() == 1:
            flat = block_ids.tolist()
    elif isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
        raise InvalidArgument("block_ids must be a sequence", field="block_ids")
    elif len(block_ids) > 0 and all(
        isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in block_ids
    ):
        flat = [int(b) for b in block_ids]  # type: ignore[arg-type]
    if flat is None:
        per_chunk = list(block_ids)
        if len(per_chunk) != len(tokens):
            raise InvalidArgument(
                f"block_ids has {len(per_chunk)} per-chunk lists for {len(tokens)} chunks",
                field="block_ids",
            )
        return per_chunk, tokens
    need = sum(blocks_for_tokens(n, layout.block_size) for n in tokens)
    if len(flat) < need:
        raise InvalidArgument(
            f"too few block ids: {sum(tokens)} tokens in {len(tokens)} chunks at block_size "
            f"{layout.block_size} need {need}, got {len(flat)}",
            field="block_ids",
            reason="TOO_FEW_BLOCK_IDS",
        )
    out: list[BlockIds] = []
    start = 0
    for n in tokens:
        count = blocks_for_tokens(n, layout.block_size)
        out.append(flat[start : start + count])
        start += count
    return out, tokens


def _as_chunk(
    buf: object,
    layout: KVLayout,
    num_tokens: int,
    field_name: str,
    *,
    writable: bool,
    size: tuple[tuple[int, int, int, int], int] | None = None,
) -> torch.Tensor:
    """``buf`` as a chunk-shaped tensor of the layout's dtype, sharing its memory
    (``size``: the chunk's shape and bytes, when the caller has them already)."""
    shape, nbytes = size or (chunk_shape(layout, num_tokens), chunk_nbytes(layout, num_tokens))
    if isinstance(buf, torch.Tensor):
        if buf.dtype == layout.dtype:
            if tuple(buf.shape) == shape:
                return buf  # the kernels check contiguity and device
            if buf.dim() == 1 and buf.numel() * layout.itemsize == nbytes:
                return _view_chunk(buf, shape, field_name)
        elif buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == nbytes:
            return _view_chunk(buf, shape, field_name, layout.dtype)
        raise InvalidArgument(
            f"{field_name} is a {buf.dtype} tensor of shape {tuple(buf.shape)}; expected "
            f"{layout.dtype} {shape}, flat {layout.dtype}, or {nbytes} raw uint8 bytes",
            field=field_name,
        )
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(
            f"{field_name} must be a tensor or a buffer, got {type(buf).__name__}",
            field=field_name,
        ) from None
    with view:
        if not view.c_contiguous:
            raise InvalidArgument(f"{field_name} must be C-contiguous", field=field_name)
        if writable and view.readonly:
            raise InvalidArgument(f"{field_name} is read-only", field=field_name)
        if view.nbytes != nbytes:
            raise InvalidArgument(
                f"{field_name} holds {view.nbytes} bytes, a {num_tokens}-token chunk is {nbytes}",
                field=field_name,
            )
    return _view_chunk(tensor_over(buf), shape, field_name, layout.dtype)


def _view_chunk(
    flat: torch.Tensor,
    shape: tuple[int, int, int, int],
    field_name: str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if not flat.is_contiguous():
        raise InvalidArgument(f"{field_name} must be contiguous", field=field_name)
    try:
        typed = flat if dtype is None else flat.view(dtype)
        return typed.view(shape)
    except RuntimeError as exc:
        raise InvalidArgument(
            f"{field_name} cannot be viewed as a chunk: {exc}", field=field_name
        ) from None
