"""Gather and scatter for vLLM's CPU layouts (``VLLM_CPU`` and ``VLLM_CPU_AMX``).

One layer is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; inside one
(block, head) K comes first, then V, each ``block_size * head_dim`` elements.

- ``VLLM_CPU`` ("vec" ISA): K transposed (``[head_dim][block_size]``), V
  ``[block_size][head_dim]``. On the CPU the native kernel
  (``kvmesh_vec_tiles``: 8x8 transposes with SSE2 for K, a run per token for V)
  moves a layer in one call (measured 16 MiB: 5 ms on one thread, 3 ms on two,
  against 7-10 ms for the torch path below); both directions write whole
  lines with streaming stores (a scatter: four transposes give 8 dims 32
  tokens each; a gather: each token's head run whole) and prefetch the rows
  they read next (docs/kernels.md, "Gather and scatter"). Without it, each plane is read through a
  strided view ``[num_blocks, block_size, kv_heads, head_dim]`` over the same
  memory: one indexed copy per (layer, plane) moves all of a chunk's whole
  blocks, and a partial last block takes one more slice copy.
- ``VLLM_CPU_AMX`` ("amx" ISA, the layout vLLM's AMX tiles read): K in tiles of
  16 tokens, each ``[head_dim / 2][16][2]``; V in tiles of 16 dims, each
  ``[block_size / 2][16][2]``: a transpose at the grain of one or two
  elements, which no strided view or run copy expresses. On the CPU the
  native kernel (``kvmesh_amx_tiles`` in ``_native/tiles_amx.c``, with AVX2 for
  2-byte elements) moves them in one pass per layer on the calling thread
  (measured 16 MiB: 4-6 ms; both directions write whole lines with streaming
  stores, and a scatter prefetches the next tile's rows, which took SmolLM2's
  31 chunks, 174 MiB, on one thread from 4.2 to 5.8 GB/s (scatter) and 3.7
  to 5.7 (gather), on two from 6.8 to 8.1 and 6.0 to 8.3, against a same-run
  memcpy of 7.3; torch
  takes 17-22 ms on two threads and twice that beside a busy engine); without
  it (an install built without it, or a GPU) each plane moves through a table
  of element offsets (:func:`head_offsets`), one indexed read or write per
  (layer, plane).

With the native kernel, a batch of chunks is one list of (chunk, layer)
copies, cut into pieces of about 2 MiB, one C call each (``kvmesh_tiles_batch``),
pulled by the copy threads: a C call per (chunk, layer) released and took
back the GIL each time, and with a small model's 128 KiB pairs two threads
ran slower than one (docs/kernels.md, "Gather and scatter").

The offsets were read off vLLM 0.32's own ``cpu_attn_reshape_and_cache`` (a
test writes K/V through it and reads them back with these kernels).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvmesh.kernels import native
from kvmesh.kernels._plan import ChunkPlan, planes_contiguous
from kvmesh.kernels.kinds import KVLayoutKind
from kvmesh.kernels.layouts import PagedKVCache

logger = logging.getLogger(__name__)


#: Runs pieces of one copy (about equal shares of its bytes) on the copy threads.
Parallel = Callable[[Sequence[Callable[[], None]], int], None]


def _serial(pieces: Sequence[Callable[[], None]], nbytes: int) -> None:
    for piece in pieces:
        piece()


def plane_views(kv: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``[num_blocks, block_size, kv_heads, head_dim]`` views."""
    assert kv.kind is KVLayoutKind.VLLM_CPU
    t = kv.layers[layer]
    bs, hd = kv.block_size, kv.head_dim
    block_stride, head_stride = t.stride(0), t.stride(1)
    shape = (kv.num_blocks, bs, kv.kv_heads, hd)
    base = int(t.storage_offset())
    # K element (token, dim) of a (block, head) sits at dim * block_size + token.
    k = t.as_strided(shape, (block_stride, 1, head_stride, bs), base)
    # V element (token, dim) sits after all of K, at token * head_dim + dim.
    v = t.as_strided(shape, (block_stride, hd, head_stride, 1), base + bs * hd)
    return k, v


def _index(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=64)
def _offsets_cpu(kind: KVLayoutKind, block_size: int, head_dim: int) -> torch.Tensor:
    t = torch.arange(block_size).view(-1, 1)
    d = torch.arange(head_dim).view(1, -1)
    plane = block_size * head_dim
    if kind is KVLayoutKind.VLLM_CPU_AMX:
        k = (t // 16) * 16 * head_dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
        v = plane + (d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2
    else:
        k = d * block_size + t
        v = plane + t * head_dim + d
    return torch.stack([k, v])


def head_offsets(kv: PagedKVCache) -> torch.Tensor:
    """``[2, block_size, head_dim]``: where K/V element (token, dim) sits in one (block, head).

    Offsets count elements from the start of the (block, head) region of
    ``2 * block_size * head_dim`` elements; plane 0 is K, plane 1 is V.
    """
    assert kv.kind.is_vllm_cpu
    return _offsets_cpu(kv.kind, kv.block_size, kv.head_dim).to(kv.device)


def gather(kv: PagedKVCache, plan: ChunkPlan, parallel: Parallel = _serial) -> None:
    """Copy one chunk's blocks into ``plan.chunk`` (``[2, layers, tokens, hidden]``)."""
    if kv.kind is KVLayoutKind.VLLM_CPU_AMX:
        _gather_tiled(kv, plan, parallel)
        return
    if _native_tiles(kv, plan, gather=True, parallel=parallel):
        return
    bs, heads, hd = kv.block_size, kv.kv_heads, kv.head_dim
    full, rem = divmod(plan.num_tokens, bs)
    out = (
        plan.chunk
        if plan.chunk.device == kv.device
        else torch.empty_like(plan.chunk, device=kv.device)
    )
    index = _index(plan.block_ids[:full], kv.device)
    for layer in range(kv.num_layers):
        for plane, src in enumerate(plane_views(kv, layer)):
            dst = out[plane, layer]
            if full:
                dst[: full * bs].view(full, bs, heads, hd).copy_(src.index_select(0, index))
            if rem:
                dst[full * bs :].view(rem, heads, hd).copy_(src[plan.block_ids[full], :rem])
    if out is not plan.chunk:
        plan.chunk.copy_(out)


def scatter(kv: PagedKVCache, plan: ChunkPlan, parallel: Parallel = _serial) -> None:
    """Copy ``plan.chunk`` into its blocks, leaving the first ``plan.skip_blocks`` untouched."""
    if kv.kind is KVLayoutKind.VLLM_CPU_AMX:
        _scatter_tiled(kv, plan, parallel)
        return
    if _native_tiles(kv, plan, gather=False, parallel=parallel):
        return
    bs, heads, hd = kv.block_size, kv.kv_heads, kv.head_dim
    full, rem = divmod(plan.num_tokens, bs)
    skip = plan.skip_blocks
    chunk = plan.chunk if plan.chunk.device == kv.device else plan.chunk.to(kv.device)
    index = _index(plan.block_ids[skip:full], kv.device) if full > skip else None
    for layer in range(kv.num_layers):
        for plane, dst in enumerate(plane_views(kv, layer)):
            src = chunk[plane, layer]
            if index is not None:
                rows = src[skip * bs : full * bs].view(full - skip, bs, heads, hd)
                dst.index_put_((index,), rows)
            if rem and full >= skip:
                dst[plan.block_ids[full], :rem] = src[full * bs :].view(rem, heads, hd)


def _regions(kv: PagedKVCache, layer: int) -> torch.Tensor:
    """One layer as ``[num_blocks, kv_heads, 2 * block_size * head_dim]`` (a view)."""
    return kv.layers[layer].view(kv.num_blocks, kv.kv_heads, -1)


def gather_all(kv: PagedKVCache, plans: Sequence[ChunkPlan], parallel: Parallel) -> None:
    """Copy every chunk's blocks into its chunk (one parallel pass for the native kernel)."""
    if _native_all(kv, plans, gather=True, parallel=parallel):
        return
    for plan in plans:
        gather(kv, plan, parallel)


def scatter_all(kv: PagedKVCache, plans: Sequence[ChunkPlan], parallel: Parallel) -> None:
    """Copy every chunk into its blocks (one parallel pass for the native kernel)."""
    if _native_all(kv, plans, gather=False, parallel=parallel):
        return
    for plan in plans:
        scatter(kv, plan, parallel)


def _native_all(
    kv: PagedKVCache, plans: Sequence[ChunkPlan], *, gather: bool, parallel: Parallel
) -> bool:
    """All chunks with the native kernel, over the copy threads; False when it cannot.

    A 32-chunk prefix of a small model is 32 pieces of well under the 1 MiB a
    per-chunk split needs; cut over the whole batch, both cores share it.
    """
    items = _native_items(kv, plans)
    if items is None:
        return False
    _run_items(kv, items, gather, parallel, sum(_nbytes(p) for p in plans))
    return True


def _native_tiles(kv: PagedKVCache, plan: ChunkPlan, *, gather: bool, parallel: Parallel) -> bool:
    """Move one chunk with the native kernel, over the copy threads; False when it cannot."""
    return _native_all(kv, [plan], gather=gather, parallel=parallel)


def _nbytes(plan: ChunkPlan) -> int:
    return plan.chunk.numel() * plan.chunk.element_size()


@dataclass
class _Items:
    """One native copy per (chunk, layer): the rows :meth:`NativeCopy.tiles_batch` takes."""

    rows: npt.NDArray[np.int64]
    #: What the rows' addresses point into, alive until the copy ran.
    keep: list[object]


def _native_items(kv: PagedKVCache, plans: Sequence[ChunkPlan]) -> _Items | None:
    """The (chunk, layer) copies of ``plans``, or None when the native kernel cannot run.

    Built with array arithmetic, not a tuple per (chunk, layer): for a 24-chunk
    load of a 4-layer model the per-row Python took 0.4 ms, a quarter of the
    copy it set up."""
    if kv.device.type != "cpu" or native.library() is None:
        return None
    for plan in plans:
        if plan.chunk.device.type != "cpu" or not planes_contiguous(plan.chunk):
            return None
    if not plans:
        return _Items(np.empty((0, 7), dtype=np.int64), [])
    n_blocks = np.array([-(-plan.num_tokens // kv.block_size) for plan in plans], dtype=np.int64)
    blocks = np.fromiter(
        (b for plan, n in zip(plans, n_blocks, strict=True) for b in plan.block_ids[:n]),
        dtype=np.int64,
        count=int(n_blocks.sum()),
    )
    block_starts = np.concatenate(([0], np.cumsum(n_blocks)[:-1]))
    item = kv.itemsize
    base = np.array([plan.chunk.data_ptr() for plan in plans], dtype=np.int64)
    plane_step = np.array([plan.chunk.stride(0) * item for plan in plans], dtype=np.int64)
    layer_step = np.array([plan.chunk.stride(1) * item for plan in plans], dtype=np.int64)
    layers = np.arange(kv.num_layers, dtype=np.int64)
    rows = np.empty((len(plans), kv.num_layers, 7), dtype=np.int64)
    rows[:, :, 0] = np.array([t.data_ptr() for t in kv.layers], dtype=np.int64)
    rows[:, :, 1] = base[:, None] + layer_step[:, None] * layers
    rows[:, :, 2] = rows[:, :, 1] + plane_step[:, None]
    rows[:, :, 3] = (blocks.ctypes.data + 8 * block_starts)[:, None]
    rows[:, :, 4] = n_blocks[:, None]
    rows[:, :, 5] = np.array([plan.num_tokens for plan in plans], dtype=np.int64)[:, None]
    rows[:, :, 6] = np.array([plan.skip_blocks for plan in plans], dtype=np.int64)[:, None]
    return _Items(rows.reshape(-1, 7), [blocks, *(plan.chunk for plan in plans)])


#: Bytes of one piece of a parallel copy: large enough that handing the GIL
#: between threads once per piece costs nothing measurable, small enough that a
#: thread the OS deschedules (another process on its core) holds up one piece
#: while the others take the rest.
_PIECE_BYTES = 2 << 20


def _run_items(
    kv: PagedKVCache, items: _Items, gather: bool, parallel: Parallel, nbytes: int
) -> None:
    """``items`` in a few pieces, one native call each, run by ``parallel``."""
    lib = native.library()
    assert lib is not None  # _native_items checked
    layout = "amx" if kv.kind is KVLayoutKind.VLLM_CPU_AMX else "vec"
    shape = (kv.kv_heads, kv.block_size, kv.head_dim, kv.itemsize)
    n = items.rows.shape[0]
    parts = max(1, min(n, nbytes // _PIECE_BYTES))

    def piece(lo: int, hi: int) -> None:
        # ``items`` (and through it every block list and chunk) stays alive in this
        # closure until the copy ran.
        lib.tiles_batch(layout, items.rows[lo:hi], shape, gather=gather)

    bounds = [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]
    parallel([functools.partial(piece, lo, hi) for lo, hi in bounds], nbytes)


def _gather_tiled(kv: PagedKVCache, plan: ChunkPlan, parallel: Parallel) -> None:
    if _native_tiles(kv, plan, gather=True, parallel=parallel):
        return
    bs, heads, hd = kv.block_size, kv.kv_heads, kv.head_dim
    n = plan.num_tokens
    blocks = -(-n // bs)
    offsets = head_offsets(kv).view(2, -1)
    index = _index(plan.block_ids[:blocks], kv.device)
    out = plan.chunk
    for layer in range(kv.num_layers):
        regions = _regions(kv, layer).index_select(0, index)  # [blocks, heads, 2*bs*hd]
        for plane in range(2):
            values = regions[:, :, offsets[plane]].view(blocks, heads, bs, hd)
            rows = values.permute(0, 2, 1, 3).reshape(blocks * bs, heads * hd)
            out[plane, layer].copy_(rows[:n])


def _scatter_tiled(kv: PagedKVCache, plan: ChunkPlan, parallel: Parallel) -> None:
    if _native_tiles(kv, plan, gather=False, parallel=parallel):
        return
    bs, heads, hd = kv.block_size, kv.kv_heads, kv.head_dim
    full, rem = divmod(plan.num_tokens, bs)
    skip = plan.skip_blocks
    chunk = plan.chunk if plan.chunk.device == kv.device else plan.chunk.to(kv.device)
    offsets = head_offsets(kv)
    head_index = torch.arange(heads, device=kv.device)
    for layer in range(kv.num_layers):
        regions = _regions(kv, layer)
        for plane in range(2):
            src = chunk[plane, layer]
            if full > skip:
                ids = _index(plan.block_ids[skip:full], kv.device)
                values = src[skip * bs : full * bs].view(full - skip, bs, heads, hd)
                values = values.permute(0, 2, 1, 3).reshape(full - skip, heads, bs * hd)
                where = (
                    ids.view(-1, 1, 1),
                    head_index.view(1, -1, 1),
                    offsets[plane].view(1, 1, -1),
                )
                regions.index_put_(where, values)
            if rem and full >= skip:
                values = src[full * bs :].view(rem, heads, hd).permute(1, 0, 2).reshape(heads, -1)
                block = plan.block_ids[full]
                where2 = (head_index.view(-1, 1), offsets[plane][:rem].reshape(1, -1))
                regions[block].index_put_(where2, values)
