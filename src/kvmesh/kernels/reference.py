"""Plain reference implementation of the gather/scatter ops (the test oracle).

One slice copy per (chunk, plane, layer, block, head), written straight from the
semantics of reference §7.4 so it is easy to check by eye. It shares only the
input validation with the fast ops in :mod:`kvmesh.kernels.ops`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvmesh.kernels._plan import BlockIds, plan_chunks
from kvmesh.kernels.layouts import KVLayoutKind, PagedKVCache

logger = logging.getLogger(__name__)


def _head_tokens(kv: PagedKVCache, layer: int, plane: int, block: int, head: int) -> torch.Tensor:
    """``[block_size, head_dim]`` view of one head of one block of one K/V plane of one layer."""
    t = kv.layers[layer]
    if kv.kind is KVLayoutKind.FLASH_ATTN:
        return t[plane, block, :, head]
    if kv.kind is KVLayoutKind.FLASHINFER:
        return t[block, plane, :, head]
    if kv.kind is KVLayoutKind.VLLM_CPU:
        flat = t[block, head].reshape(-1)  # K as [head_dim][block_size], then V
        split = kv.head_dim * kv.block_size
        if plane == 0:
            return flat[:split].view(kv.head_dim, kv.block_size).t()
        return flat[split:].view(kv.block_size, kv.head_dim)
    return t[block]


def _chunk_head(
    chunk: torch.Tensor, kv: PagedKVCache, plane: int, layer: int, head: int
) -> torch.Tensor:
    """``[num_tokens, head_dim]`` view of one head's columns of a chunk object."""
    return chunk[plane, layer, :, head * kv.head_dim : (head + 1) * kv.head_dim]


def ref_gather_chunks(
    kv: PagedKVCache, block_ids: Sequence[BlockIds], outs: Sequence[torch.Tensor]
) -> None:
    """Reference of :func:`kvmesh.kernels.ops.gather_chunks`: paged blocks → chunk objects."""
    plans = plan_chunks(kv, block_ids, outs, chunks_field="outs")
    bs = kv.block_size
    for plan in plans:
        for plane in range(kv.kv_size):
            for layer in range(kv.num_layers):
                for j, block in enumerate(plan.block_ids):
                    count = min(bs, plan.num_tokens - j * bs)
                    for head in range(kv.kv_heads):
                        src = _head_tokens(kv, layer, plane, block, head)[:count]
                        dst = _chunk_head(plan.chunk, kv, plane, layer, head)
                        dst[j * bs : j * bs + count] = src.to(plan.chunk.device)


def ref_scatter_chunks(
    kv: PagedKVCache,
    block_ids: Sequence[BlockIds],
    srcs: Sequence[torch.Tensor],
    skip_first_n_tokens: int = 0,
) -> None:
    """Reference of :func:`kvmesh.kernels.ops.scatter_chunks`: chunk objects → paged blocks."""
    plans = plan_chunks(
        kv,
        block_ids,
        srcs,
        chunks_field="srcs",
        skip_first_n_tokens=skip_first_n_tokens,
        forbid_duplicates=True,
    )
    bs = kv.block_size
    for plan in plans:
        for plane in range(kv.kv_size):
            for layer in range(kv.num_layers):
                for j, block in enumerate(plan.block_ids):
                    if j < plan.skip_blocks:
                        continue
                    count = min(bs, plan.num_tokens - j * bs)
                    for head in range(kv.kv_heads):
                        src = _chunk_head(plan.chunk, kv, plane, layer, head)
                        dst = _head_tokens(kv, layer, plane, block, head)
                        dst[:count] = src[j * bs : j * bs + count].to(kv.device)
