"""Gather and scatter for vLLM's CPU layout (``KVLayoutKind.VLLM_CPU``).

One layer is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``. Inside one
(block, head) K comes first, stored transposed (``[head_dim][block_size]``),
then V (``[block_size][head_dim]``). K's transposition rules out the row copies
of :mod:`kvmesh.kernels.ops`, so each plane is read through a strided view
``[num_blocks, block_size, kv_heads, head_dim]`` over the same memory: one
indexed copy per (layer, plane) moves all of a chunk's whole blocks, and a
partial last block takes one more slice copy.
"""

from __future__ import annotations

import logging

import torch

from kvmesh.kernels._plan import ChunkPlan
from kvmesh.kernels.layouts import KVLayoutKind, PagedKVCache

logger = logging.getLogger(__name__)


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


def gather(kv: PagedKVCache, plan: ChunkPlan) -> None:
    """Copy one chunk's blocks into ``plan.chunk`` (``[2, layers, tokens, hidden]``)."""
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


def scatter(kv: PagedKVCache, plan: ChunkPlan) -> None:
    """Copy ``plan.chunk`` into its blocks, leaving the first ``plan.skip_blocks`` untouched."""
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
