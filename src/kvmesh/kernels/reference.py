"""Plain reference implementation of the gather/scatter ops (the test oracle).

One slice copy per (chunk, plane, layer, block, head), written straight from the
semantics in docs/kernels.md, "Gather and scatter", so it is easy to check by
eye. It shares only the input validation with the fast ops in
:mod:`kvmesh.kernels.ops`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvmesh.kernels._plan import BlockIds, plan_chunks
from kvmesh.kernels.kinds import KVLayoutKind
from kvmesh.kernels.layouts import PagedKVCache

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


def _amx_token(
    kv: PagedKVCache, layer: int, plane: int, block: int, head: int, token: int
) -> torch.Tensor:
    """One token's ``head_dim`` values of a ``VLLM_CPU_AMX`` (block, head), as a view.

    Straight from the layout's text: K tiles of 16 tokens ``[head_dim / 2][16][2]``
    (the view ``[16-token tile, token in tile, dim pair, dim in pair]``), then V
    tiles of 16 dims ``[block_size / 2][16][2]`` (``[token pair, token in pair,
    16-dim tile, dim in tile]``). The view's elements, in order, are dims 0, 1, ...
    """
    bs, hd = kv.block_size, kv.head_dim
    flat = kv.layers[layer][block, head].reshape(-1)
    base = int(flat.storage_offset())
    if plane == 0:
        k = flat.as_strided((bs // 16, 16, hd // 2, 2), (16 * hd, 2, 32, 1), base)
        return k[token // 16, token % 16]
    v = flat.as_strided((bs // 2, 2, hd // 16, 16), (32, 1, 16 * bs, 2), base + bs * hd)
    return v[token // 2, token % 2]


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
                        dst = _chunk_head(plan.chunk, kv, plane, layer, head)
                        if kv.kind is KVLayoutKind.VLLM_CPU_AMX:
                            for t in range(count):
                                row = _amx_token(kv, layer, plane, block, head, t)
                                dst[j * bs + t] = row.reshape(-1).to(plan.chunk.device)
                            continue
                        src = _head_tokens(kv, layer, plane, block, head)[:count]
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
                        if kv.kind is KVLayoutKind.VLLM_CPU_AMX:
                            for t in range(count):
                                row = _amx_token(kv, layer, plane, block, head, t)
                                row.copy_(src[j * bs + t].view(row.shape).to(kv.device))
                            continue
                        dst = _head_tokens(kv, layer, plane, block, head)
                        dst[:count] = src[j * bs : j * bs + count].to(kv.device)
