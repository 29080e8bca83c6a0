"""Gather (store) and scatter (retrieve) between paged KV layouts and L1 chunk objects.

How the copies are done, and why (figures from ``python -m kvmesh.bench.kernels``):

- Every layout keeps each block of each K/V plane of each layer as one
  contiguous run of ``block_size * kv_heads * head_dim`` elements, and the
  chunk object keeps the same run contiguous. So both directions are row
  copies: view both sides as rows (a whole block; ``gcd(num_tokens,
  block_size)`` tokens when a chunk ends inside a block) and move rows by
  index. When every layer lives in one storage (one shared-memory file) a
  chunk is one indexed copy over that storage, otherwise one per (plane, layer).
- On CPU, when the native kernel is loaded (:mod:`kvmesh.kernels.native`,
  ``kernels/_native/ntcopy.c``), each chunk becomes one list of runs
  ``(source offset, destination offset)`` of one row each, copied by C with
  non-temporal stores, several runs side by side, split into ~2 MiB pieces
  over :func:`copy_threads` threads (the C call releases the GIL; one thread
  makes one call). One thread reaches 0.9–1.0 of a one-thread 32 MiB
  ``memcpy``, where every alternative below stops at about half (see "One
  thread reaches about half"); two reach 1.2–1.7 when the second core is
  free, about one thread's figure when another process holds it.
- Otherwise (an install built without the kernel, ``KVMESH_NATIVE_COPY=0``, or
  a CUDA chunk with a CPU cache) the rows are NumPy ``void``
  items (one opaque item per row), moved with ``np.take(mode="clip", out=)``
  (gather) and a fancy assignment (scatter): one ``memcpy`` per row with the
  GIL released, split over :func:`copy_threads` threads by this module, one
  hand-off per chunk.
- Measured alternatives on CPU: ``torch.index_select(out=)`` gathers at the
  same speed on one thread and ~10 % faster on two when the box is quiet, but
  its OpenMP fork/join per call collapses when another process holds a core
  (0.1–0.7 GB/s for the per-layer path, several runs); ``index_put_`` /
  ``index_copy_`` scatter element by element (50–75 % of NumPy, and collapse
  the same way); per-block ``copy_`` or ctypes ``memmove`` loops pay 1–3 µs of
  Python per 32 KiB block; one advanced index per layer allocates (~0.2×).
- One thread reaches about half of a 32 MiB ``memcpy`` with any of these
  methods: 32 KiB block runs go through cached stores (a read for ownership
  per line) while glibc switches a 32 MiB ``memcpy`` to non-temporal stores.
  Two threads close most of the gap; the native kernel closes it on one.
- On CUDA, gather is ``index_select`` and scatter ``index_put_`` over rows
  viewed as the widest integer type that fits (8 bytes per thread). A chunk on
  CPU with the cache on CUDA (or the reverse) is staged through a temporary on
  the cache's device.

Indices are validated before any copy (:mod:`kvmesh.kernels._plan`). Row views cover
only the cache's storage; NumPy's assignment and torch's ops are
bounds-checked and the clipped take cannot read past the view, so even a
wrong index could not reach memory outside that storage. The native path
has no such net under it, so it checks every row index against its view
before handing raw addresses to C.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvmesh.kernels import native, vllm_cpu
from kvmesh.kernels._plan import BlockIds, ChunkPlan, plan_chunks
from kvmesh.kernels.layouts import PagedKVCache
from kvmesh.kernels.parallel import copy_threads, group, num_pieces, run_parallel, split

logger = logging.getLogger(__name__)

#: Which implementation copies for a CPU cache: "native" (the default: the C
#: kernel when it is loaded, NumPy otherwise), "numpy", or "torch" (the ops
#: CUDA runs). Tests run all three; the benchmark compares them.
_CPU_BACKEND = "native"


def _use_numpy(kv: PagedKVCache) -> bool:
    return kv.device.type == "cpu" and _CPU_BACKEND != "torch"


def _native_kernel(kv: PagedKVCache) -> native.NativeCopy | None:
    """The native kernel for a CPU cache, or None (see :func:`kvmesh.kernels.native.library`)."""
    if kv.device.type != "cpu" or _CPU_BACKEND != "native":
        return None
    return native.library()


def _row_geometry(kv: PagedKVCache, num_tokens: int) -> tuple[int, int, int]:
    """(rows per block, rows in the chunk, elements per row) for a chunk of ``num_tokens``.

    A row is ``gcd(num_tokens, block_size)`` tokens: whole blocks for a full
    chunk, smaller pieces only when the chunk ends inside a block.
    """
    tokens_per_row = math.gcd(num_tokens, kv.block_size)
    return (
        kv.block_size // tokens_per_row,
        num_tokens // tokens_per_row,
        tokens_per_row * kv.hidden,
    )


# The index helpers use NumPy: a handful of small torch ops costs ~0.3 ms per
# chunk on a busy box (~10 % of a 32 MiB copy), the same in NumPy ~20 µs.


def _rows_in_layer(
    kv: PagedKVCache, plan: ChunkPlan, rows_per_block: int, first_row: int
) -> npt.NDArray[np.int64]:
    """``[kv_size, rows]`` row indices inside one layer for the chunk's rows from ``first_row``."""
    kv_stride, block_stride = kv._row_strides(rows_per_block)
    _, num_rows, _ = _row_geometry(kv, plan.num_tokens)
    r = np.arange(first_row, num_rows, dtype=np.int64)
    ids = np.array(plan.block_ids, dtype=np.int64)
    per_row = ids[r // rows_per_block] * block_stride + r % rows_per_block
    planes = np.arange(kv.kv_size, dtype=np.int64) * kv_stride
    return planes[:, None] + per_row[None, :]


def _fused_index(
    kv: PagedKVCache, plan: ChunkPlan, rows_per_block: int, first_row: int
) -> npt.NDArray[np.int64]:
    """``[kv_size, num_layers, rows]`` row indices inside the fused storage view."""
    in_layer = _rows_in_layer(kv, plan, rows_per_block, first_row)
    bases = np.array(kv._layer_row_bases(rows_per_block), dtype=np.int64)
    return in_layer[:, None, :] + bases[None, :, None]


def _device_index(index: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(index).to(device)


def _chunk_rows(
    chunk: torch.Tensor, kv: PagedKVCache, num_rows: int, row_elems: int
) -> torch.Tensor:
    """The chunk as ``[kv_size, num_layers, rows, row_elems]`` (a view: chunks are contiguous)."""
    return chunk.view(kv.kv_size, kv.num_layers, num_rows, row_elems)


def _void_rows(rows: torch.Tensor) -> npt.NDArray[Any]:
    """CPU rows ``[..., row_elems]`` as a NumPy array of one opaque item per row."""
    arr = rows.view(torch.uint8).numpy()
    return arr.view(np.dtype((np.void, arr.shape[-1])))[..., 0]


def _take_task(
    src: npt.NDArray[Any], index: npt.NDArray[Any], out: npt.NDArray[Any]
) -> Callable[[], None]:
    def run() -> None:
        # mode="clip": "raise" with out= buffers the whole result (3x slower); the
        # indices are validated, and clipping keeps reads inside the row view anyway.
        np.take(src, index, out=out, mode="clip")

    return run


def _assign_task(
    dst: npt.NDArray[Any], index: npt.NDArray[Any], values: npt.NDArray[Any]
) -> Callable[[], None]:
    def run() -> None:
        dst[index] = values  # bounds-checked by NumPy

    return run


def _gather_numpy(kv: PagedKVCache, plan: ChunkPlan) -> None:
    rows_per_block, num_rows, row_elems = _row_geometry(kv, plan.num_tokens)
    out = plan.chunk
    if out.device.type != "cpu":
        out = torch.empty(out.shape, dtype=out.dtype)
    out_rows = _void_rows(_chunk_rows(out, kv, num_rows, row_elems))  # [kv, layers, rows]
    nbytes = out_rows.size * row_elems * kv.itemsize
    pieces = num_pieces(nbytes)
    if kv.fused:
        src = kv._fused_void_rows(rows_per_block)
        index = _fused_index(kv, plan, rows_per_block, 0).reshape(-1)
        flat_out = out_rows.reshape(-1)
        tasks = [
            _take_task(src, index[lo:hi], flat_out[lo:hi]) for lo, hi in split(index.size, pieces)
        ]
    else:
        index = _rows_in_layer(kv, plan, rows_per_block, 0)
        per_plane = [
            _take_task(
                kv._layer_void_rows(layer, rows_per_block), index[plane], out_rows[plane, layer]
            )
            for layer in range(kv.num_layers)
            for plane in range(kv.kv_size)
        ]
        tasks = group(per_plane, pieces)
    run_parallel(tasks, nbytes)
    if out is not plan.chunk:
        plan.chunk.copy_(out)


def _scatter_numpy(kv: PagedKVCache, plan: ChunkPlan) -> None:
    rows_per_block, num_rows, row_elems = _row_geometry(kv, plan.num_tokens)
    first_row = plan.skip_blocks * rows_per_block
    if first_row >= num_rows:
        return
    src = plan.chunk if plan.chunk.device.type == "cpu" else plan.chunk.cpu()
    src_rows = _void_rows(_chunk_rows(src, kv, num_rows, row_elems))[:, :, first_row:]
    nbytes = src_rows.size * row_elems * kv.itemsize
    pieces = num_pieces(nbytes)
    if kv.fused:
        dst = kv._fused_void_rows(rows_per_block)
        index = _fused_index(kv, plan, rows_per_block, first_row)
        # [(plane, layer), row]: merging the leading dims keeps a skip's slice a view.
        flat_index = index.reshape(-1, index.shape[-1])
        flat_src = src_rows.reshape(-1, src_rows.shape[-1])
        tasks = [
            _assign_task(dst, flat_index[lo:hi], flat_src[lo:hi])
            for lo, hi in split(flat_index.shape[0], pieces)
        ]
    else:
        index = _rows_in_layer(kv, plan, rows_per_block, first_row)
        per_layer = [
            _assign_task(kv._layer_void_rows(layer, rows_per_block), index, src_rows[:, layer])
            for layer in range(kv.num_layers)
        ]
        tasks = group(per_layer, pieces)
    run_parallel(tasks, nbytes)


def _check_rows(index: npt.NDArray[np.int64], limit: int) -> None:
    """Every row index inside ``[0, limit)``: the native kernel gets raw addresses."""
    if index.size and (int(index.min()) < 0 or int(index.max()) >= limit):
        raise RuntimeError(f"row index outside [0, {limit}) after validation")  # a bug


def _native_runs(
    kv: PagedKVCache, plan: ChunkPlan, first_row: int
) -> tuple[int, npt.NDArray[np.int64], int, npt.NDArray[np.int64], int]:
    """The chunk's rows from ``first_row`` on as runs for the native kernel.

    Returns ``(paged base address, paged byte offsets, chunk base address,
    chunk byte offsets, row bytes)``, both offset arrays in chunk order
    (plane, layer, row). A per-layer cache uses its lowest layer's address as
    the base, so one list of offsets covers every layer.
    """
    rows_per_block, num_rows, row_elems = _row_geometry(kv, plan.num_tokens)
    row_bytes = row_elems * kv.itemsize
    if kv.fused:
        view = kv._fused_rows(rows_per_block, torch.uint8)
        index = _fused_index(kv, plan, rows_per_block, first_row)
        _check_rows(index, view.shape[0])
        paged_base = view.data_ptr()
        paged = index.reshape(-1) * row_bytes
    else:
        in_layer = _rows_in_layer(kv, plan, rows_per_block, first_row)
        _check_rows(in_layer, kv.layers[0].numel() // row_elems)
        ptrs = np.array([layer.data_ptr() for layer in kv.layers], dtype=np.int64)
        paged_base = int(ptrs.min())
        layer_offsets = ptrs - paged_base
        paged = (layer_offsets[None, :, None] + in_layer[:, None, :] * row_bytes).reshape(-1)
    chunk_rows = np.arange(kv.kv_size * kv.num_layers * num_rows, dtype=np.int64)
    chunk = chunk_rows.reshape(kv.kv_size, kv.num_layers, num_rows)[:, :, first_row:] * row_bytes
    return paged_base, paged, plan.chunk.data_ptr(), chunk.reshape(-1), row_bytes


def _native_task(
    kernel: native.NativeCopy,
    src_base: int,
    dst_base: int,
    src_off: npt.NDArray[np.int64],
    dst_off: npt.NDArray[np.int64],
    row_bytes: int,
) -> Callable[[], None]:
    def run() -> None:
        # The closure holds the offset arrays; the caller holds the tensors.
        kernel.copy_runs_at(
            src_base, dst_base, src_off.ctypes.data, dst_off.ctypes.data, src_off.size, row_bytes
        )

    return run


def _copy_native(
    kernel: native.NativeCopy, kv: PagedKVCache, plan: ChunkPlan, *, gather: bool
) -> None:
    """Gather (paged → chunk) or scatter (chunk → paged) one CPU chunk with the native kernel."""
    rows_per_block, num_rows, _ = _row_geometry(kv, plan.num_tokens)
    first_row = 0 if gather else plan.skip_blocks * rows_per_block
    if first_row >= num_rows:
        return
    paged_base, paged, chunk_base, chunk, row_bytes = _native_runs(kv, plan, first_row)
    if gather:
        src_base, src_off, dst_base, dst_off = paged_base, paged, chunk_base, chunk
    else:
        src_base, src_off, dst_base, dst_off = chunk_base, chunk, paged_base, paged
    nbytes = src_off.size * row_bytes
    # One thread makes one call: each call ends with a store fence and restarts
    # its streams, ~4 % of a 32 MiB copy cut into 16 pieces.
    pieces = num_pieces(nbytes) if copy_threads() > 1 else 1
    tasks = [
        _native_task(kernel, src_base, dst_base, src_off[lo:hi], dst_off[lo:hi], row_bytes)
        for lo, hi in split(src_off.size, pieces)
    ]
    run_parallel(tasks, nbytes)


def _row_dtype(row_bytes: int, *byte_offsets: int) -> torch.dtype:
    """Widest integer dtype dividing the row and every view's start (wider = fewer GPU ops)."""
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % width == 0 and all(o % width == 0 for o in byte_offsets):
            return dtype
    return torch.uint8


def _gather_torch(kv: PagedKVCache, plan: ChunkPlan) -> None:
    rows_per_block, num_rows, row_elems = _row_geometry(kv, plan.num_tokens)
    out = plan.chunk
    if out.device != kv.device:
        out = torch.empty(out.shape, dtype=out.dtype, device=kv.device)
    row_dtype = _row_dtype(
        row_elems * kv.itemsize,
        int(out.storage_offset()) * kv.itemsize,
        *kv._paged_byte_offsets(),
    )
    out_rows = _chunk_rows(out, kv, num_rows, row_elems).view(row_dtype)
    if kv.fused:
        index = _device_index(_fused_index(kv, plan, rows_per_block, 0), kv.device)
        src = kv._fused_rows(rows_per_block, row_dtype)
        torch.index_select(src, 0, index.view(-1), out=out_rows.view(-1, out_rows.shape[-1]))
    else:
        index = _device_index(_rows_in_layer(kv, plan, rows_per_block, 0), kv.device)
        for layer in range(kv.num_layers):
            src = kv._layer_rows(layer, rows_per_block, row_dtype)
            for plane in range(kv.kv_size):
                torch.index_select(src, 0, index[plane], out=out_rows[plane, layer])
    if out is not plan.chunk:
        plan.chunk.copy_(out)


def _scatter_torch(kv: PagedKVCache, plan: ChunkPlan) -> None:
    rows_per_block, num_rows, row_elems = _row_geometry(kv, plan.num_tokens)
    first_row = plan.skip_blocks * rows_per_block
    if first_row >= num_rows:
        return
    src = plan.chunk
    if src.device != kv.device:
        src = src.to(kv.device)
    row_dtype = _row_dtype(
        row_elems * kv.itemsize,
        int(src.storage_offset()) * kv.itemsize,
        *kv._paged_byte_offsets(),
    )
    src_rows = _chunk_rows(src, kv, num_rows, row_elems).view(row_dtype)[:, :, first_row:]
    if kv.fused:
        index = _device_index(_fused_index(kv, plan, rows_per_block, first_row), kv.device)
        kv._fused_rows(rows_per_block, row_dtype).index_put_((index,), src_rows)
    else:
        index = _device_index(_rows_in_layer(kv, plan, rows_per_block, first_row), kv.device)
        for layer in range(kv.num_layers):
            dst = kv._layer_rows(layer, rows_per_block, row_dtype)
            dst.index_put_((index,), src_rows[:, layer])


def gather_chunks(
    kv: PagedKVCache, block_ids: Sequence[BlockIds], outs: Sequence[torch.Tensor]
) -> None:
    """Copy paged KV blocks into L1 chunk objects (the store direction).

    ``outs[i]`` is a contiguous ``[kv_size, num_layers, num_tokens_i,
    kv_heads*head_dim]`` tensor of the cache's dtype; its token count says how
    many tokens chunk ``i`` holds. Chunk ``i`` reads its tokens from the blocks
    ``block_ids[i][:ceil(num_tokens_i / block_size)]`` in order; a partial
    last block contributes only its first tokens. Extra block ids are ignored.

    Raises :class:`~kvmesh.common.errors.InvalidArgument` (before any copy)
    when a chunk has the wrong shape/dtype/device, too few block ids, or a
    block id outside ``[0, num_blocks)``.
    """
    plans = plan_chunks(kv, block_ids, outs, chunks_field="outs")
    if kv.kind.is_vllm_cpu:
        vllm_cpu.gather_all(kv, plans, run_parallel)
        return
    kernel = _native_kernel(kv)
    gather_one = _gather_numpy if _use_numpy(kv) else _gather_torch
    for plan in plans:
        if kernel is not None and plan.chunk.device.type == "cpu":
            _copy_native(kernel, kv, plan, gather=True)
        else:
            gather_one(kv, plan)


def scatter_chunks(
    kv: PagedKVCache,
    block_ids: Sequence[BlockIds],
    srcs: Sequence[torch.Tensor],
    skip_first_n_tokens: int = 0,
) -> None:
    """Copy L1 chunk objects into paged KV blocks (the retrieve direction).

    The exact inverse of :func:`gather_chunks`, except that the first
    ``skip_first_n_tokens // block_size`` blocks of the batch's range (chunk 0
    first, across chunk boundaries) are not written: they are the engine's own
    prefix-cache blocks, possibly being read concurrently. A partial last
    block is written only up to the chunk's last token; nothing else in the
    cache changes.

    Raises :class:`~kvmesh.common.errors.InvalidArgument` (before any copy)
    for the same reasons as :func:`gather_chunks`, for a negative skip, and
    when one block would be written twice.
    """
    plans = plan_chunks(
        kv,
        block_ids,
        srcs,
        chunks_field="srcs",
        skip_first_n_tokens=skip_first_n_tokens,
        forbid_duplicates=True,
    )
    if kv.kind.is_vllm_cpu:
        vllm_cpu.scatter_all(kv, plans, run_parallel)
        return
    kernel = _native_kernel(kv)
    scatter_one = _scatter_numpy if _use_numpy(kv) else _scatter_torch
    for plan in plans:
        if kernel is not None and plan.chunk.device.type == "cpu":
            _copy_native(kernel, kv, plan, gather=False)
        else:
            scatter_one(kv, plan)
