"""Plain reference implementation of the gather/scatter ops (the test oracle).

One slice copy per (chunk, plane, layer, block), written straight from the
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


def _block_tokens(kv: PagedKVCache, layer: int, plane: int, block: int) -> torch.Tensor:
    """``[block_size, hidden]`` view of one block of one K/V plane of one layer."""
    t = kv.layers[layer]
    if kv.kind is KVLayoutKind.FLASH_ATTN:
        blk = t[plane, block]
    elif kv.kind is KVLayoutKind.FLASHINFER:
        blk = t[block, plane]
    else:
        blk = t[block]
    return blk.reshape(kv.block_size, kv.hidden)


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
                    src = _block_tokens(kv, layer, plane, block)[:count]
                    plan.chunk[plane, layer, j * bs : j * bs + count] = src.to(plan.chunk.device)


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
                    dst = _block_tokens(kv, layer, plane, block)
                    dst[:count] = plan.chunk[plane, layer, j * bs : j * bs + count].to(kv.device)
