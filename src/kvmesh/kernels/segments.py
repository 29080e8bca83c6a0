"""Segments (CacheBlend documents) in and out of paged KV blocks, keys moved by re-RoPE.

A segment object holds one document's K/V for tokens that sit anywhere in a
prompt. Its layout is an L1 chunk object of the segment's length
(``[2, num_layers, num_tokens, kv_heads * head_dim]``) with the keys rotated
to positions ``0..num_tokens-1`` (docs/blend.md, "Segments in storage"), so a document
stored after one prefix is found after any other.

- :func:`gather_segment` reads tokens ``[start, start + n)`` of a request
  from its blocks and rotates the keys from ``start..`` back to ``0..``.
- :func:`scatter_segment` writes a segment into a request's blocks at
  ``start`` with the keys rotated from ``0..`` to ``start..``.

``start`` need not fall on a block boundary. Both work for every layout with
K and V planes (not MLA, whose latent mixes the rotary part with the rest)
through the fast chunk kernels of :mod:`kvmesh.kernels.ops`: the blocks the
segment touches are gathered whole into a chunk-shaped buffer, the segment's
rows are written into it, and the blocks are scattered back, so the rows of a
partial first or last block that are not the segment's come back unchanged.
The engine must not write those blocks meanwhile (they belong to the request
being filled).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels._plan import BlockIds, blocks_for_tokens, check_chunk_tensor
from kvmesh.kernels.kinds import KVLayoutKind
from kvmesh.kernels.layouts import PagedKVCache
from kvmesh.kernels.ops import gather_chunks, scatter_chunks
from kvmesh.kernels.rope import RopeParams, rerope

__all__ = ["gather_segment", "scatter_segment"]


def _check(kv: PagedKVCache, rope: RopeParams, start: int) -> None:
    if kv.kind is KVLayoutKind.MLA:
        raise InvalidArgument(
            "MLA caches have no separate key plane to re-RoPE; segments need K and V",
            field="layout",
            reason="SEGMENT_LAYOUT",
        )
    if rope.head_dim != kv.head_dim:
        raise InvalidArgument(
            f"the RoPE head_dim {rope.head_dim} is not the cache's {kv.head_dim}", field="rope"
        )
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidArgument(f"start must be an int >= 0, got {start!r}", field="start")


def _span(
    kv: PagedKVCache, block_table: BlockIds, start: int, num_tokens: int
) -> tuple[list[int], int]:
    """The block ids holding tokens ``[start, start + num_tokens)`` and the first one's offset."""
    ids = block_table.tolist() if isinstance(block_table, torch.Tensor) else list(block_table)
    first = start // kv.block_size
    need = blocks_for_tokens(start + num_tokens, kv.block_size)
    if len(ids) < need:
        raise InvalidArgument(
            f"the block table has {len(ids)} blocks; tokens [{start}, {start + num_tokens}) at "
            f"block_size {kv.block_size} need {need}",
            field="block_table",
            reason="TOO_FEW_BLOCK_IDS",
        )
    return ids[first:need], start - first * kv.block_size


def _move_keys(
    kv: PagedKVCache, keys: torch.Tensor, src: int, dst: int, rope: RopeParams
) -> torch.Tensor:
    """``keys`` ([num_layers, n, hidden]) roped at ``src..`` moved to ``dst..``."""
    layers, n, _ = keys.shape
    if src == dst:
        return keys
    heads = keys.reshape(layers, n, kv.kv_heads, kv.head_dim).transpose(0, 1)
    heads = heads.reshape(n, layers * kv.kv_heads, kv.head_dim)
    positions = torch.arange(n, dtype=torch.int64, device=keys.device)
    moved = rerope(heads, positions + src, positions + dst, rope)
    return moved.reshape(n, layers, kv.hidden).transpose(0, 1)


def _buffer(kv: PagedKVCache, blocks: Sequence[int], offset: int, n: int) -> torch.Tensor:
    """The touched blocks as one chunk-shaped tensor (gathered when a block is partial)."""
    span = len(blocks) * kv.block_size
    buf = torch.empty(kv.chunk_shape(span), dtype=kv.dtype, device=kv.device)
    if offset or (offset + n) % kv.block_size:
        gather_chunks(kv, [blocks], [buf])
    return buf


def scatter_segment(
    kv: PagedKVCache, block_table: BlockIds, segment: torch.Tensor, start: int, rope: RopeParams
) -> None:
    """Write ``segment`` (keys at ``0..``) as tokens ``[start, start + n)`` of the request
    whose blocks are ``block_table``, its keys rotated to ``start..``; values as they are.

    Raises :class:`~kvmesh.common.errors.InvalidArgument` before any write for an MLA
    cache, a segment of the wrong shape or dtype, a negative start, a block table too
    short for ``start + n`` tokens, a block id out of range or one listed twice.
    """
    _check(kv, rope, start)
    n = check_chunk_tensor(kv, segment, "segment")
    blocks, offset = _span(kv, block_table, start, n)
    buf = _buffer(kv, blocks, offset, n)
    rows = slice(offset, offset + n)
    buf[0, :, rows] = _move_keys(kv, segment[0].to(kv.device), 0, start, rope)
    buf[1, :, rows] = segment[1]
    scatter_chunks(kv, [blocks], [buf])


def gather_segment(
    kv: PagedKVCache, block_table: BlockIds, out: torch.Tensor, start: int, rope: RopeParams
) -> None:
    """Fill ``out`` (``[2, num_layers, n, hidden]``) with tokens ``[start, start + n)`` of
    the request whose blocks are ``block_table``, its keys rotated back to ``0..``.

    Raises :class:`~kvmesh.common.errors.InvalidArgument` as :func:`scatter_segment`
    does (duplicate block ids are fine here: nothing is written to the cache).
    """
    _check(kv, rope, start)
    n = check_chunk_tensor(kv, out, "out")
    blocks, offset = _span(kv, block_table, start, n)
    span = len(blocks) * kv.block_size
    buf = torch.empty(kv.chunk_shape(span), dtype=kv.dtype, device=kv.device)
    gather_chunks(kv, [blocks], [buf])
    rows = slice(offset, offset + n)
    out[0] = _move_keys(kv, buf[0, :, rows], start, 0, rope).to(out.device)
    out[1] = buf[1, :, rows].to(out.device)
