"""Validation shared by the fast ops and the reference implementation.

Everything a gather or scatter call is told is checked here, for every chunk of
the batch, before either implementation copies a byte: a bad chunk late in a
batch must not leave earlier chunks half written.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels.layouts import PagedKVCache

logger = logging.getLogger(__name__)

#: One chunk's block ids: a sequence of ints or a 1-D integer tensor. Longer
#: lists are fine (only the first ``ceil(num_tokens / block_size)`` are used).
BlockIds: TypeAlias = Sequence[int] | torch.Tensor

_INTEGER_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


@dataclass(frozen=True)
class ChunkPlan:
    """One validated chunk of a gather/scatter batch.

    ``block_ids`` holds exactly the ids the chunk uses; ``skip_blocks`` is how
    many of them a scatter leaves unwritten (always 0 for a gather).
    """

    num_tokens: int
    block_ids: tuple[int, ...]
    skip_blocks: int
    chunk: torch.Tensor


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (the last one may be partial)."""
    return -(-num_tokens // block_size)


def _normalize_ids(ids: object, field: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise InvalidArgument(f"{field} must be 1-D, got shape {tuple(ids.shape)}", field=field)
        if ids.dtype not in _INTEGER_DTYPES:
            raise InvalidArgument(f"{field} must be integers, got {ids.dtype}", field=field)
        return [int(v) for v in ids.tolist()]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidArgument(
            f"{field} must be a sequence of ints, got {type(ids).__name__}", field=field
        )
    out: list[int] = []
    for v in ids:
        if isinstance(v, bool):
            raise InvalidArgument(f"{field} holds a bool, not a block id", field=field)
        try:
            out.append(operator.index(v))
        except TypeError:
            raise InvalidArgument(
                f"{field} holds {type(v).__name__}, not an integer block id", field=field
            ) from None
    return out


def check_chunk_tensor(kv: PagedKVCache, chunk: object, field: str) -> int:
    """Check one L1 chunk tensor against ``kv``; return its number of tokens."""
    if not isinstance(chunk, torch.Tensor):
        raise InvalidArgument(f"{field} must be a tensor, got {type(chunk).__name__}", field=field)
    if chunk.dtype != kv.dtype:
        raise InvalidArgument(
            f"{field} has dtype {chunk.dtype}, the KV cache is {kv.dtype}", field=field
        )
    if chunk.dim() != 4:
        raise InvalidArgument(
            f"{field} must be [kv_size, num_layers, num_tokens, kv_heads*head_dim], got shape "
            f"{tuple(chunk.shape)}",
            field=field,
        )
    kv_size, num_layers, num_tokens, hidden = chunk.shape
    if (kv_size, num_layers, hidden) != (kv.kv_size, kv.num_layers, kv.hidden) or num_tokens < 1:
        raise InvalidArgument(
            f"{field} has shape {tuple(chunk.shape)}, expected "
            f"{kv.chunk_shape(max(int(num_tokens), 1))} for this KV cache",
            field=field,
        )
    if not chunk.is_contiguous() and not (kv.kind.is_vllm_cpu and planes_contiguous(chunk)):
        raise InvalidArgument(f"{field} must be contiguous", field=field)
    if chunk.device != kv.device and {chunk.device.type, kv.device.type} != {"cpu", "cuda"}:
        raise InvalidArgument(
            f"{field} is on {chunk.device}, the KV cache on {kv.device}", field=field
        )
    return int(num_tokens)


def plan_chunks(
    kv: PagedKVCache,
    block_ids: Sequence[BlockIds],
    chunks: Sequence[torch.Tensor],
    *,
    chunks_field: str,
    skip_first_n_tokens: int = 0,
    forbid_duplicates: bool = False,
) -> list[ChunkPlan]:
    """Validate a whole batch and return one :class:`ChunkPlan` per chunk.

    ``skip_first_n_tokens`` counts from the start of the batch's token range
    (chunk 0's first token): the first ``skip_first_n_tokens // block_size``
    blocks of the range, across chunk boundaries, are marked skipped (LMCache
    rounds a non-block-aligned skip down the same way). ``forbid_duplicates``
    (scatter) rejects a block written twice: which copy would win is
    unspecified on a GPU, and no engine sends that on purpose.
    """
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
        raise InvalidArgument(
            "block_ids must be a sequence, one entry per chunk", field="block_ids"
        )
    if isinstance(chunks, torch.Tensor) or not isinstance(chunks, Sequence):
        raise InvalidArgument(f"{chunks_field} must be a sequence of tensors", field=chunks_field)
    if len(block_ids) != len(chunks):
        raise InvalidArgument(
            f"block_ids has {len(block_ids)} entries but {chunks_field} has {len(chunks)}",
            field="block_ids",
        )
    if isinstance(skip_first_n_tokens, bool) or not isinstance(skip_first_n_tokens, int):
        raise InvalidArgument("skip_first_n_tokens must be an int", field="skip_first_n_tokens")
    if skip_first_n_tokens < 0:
        raise InvalidArgument(
            f"skip_first_n_tokens must be >= 0, got {skip_first_n_tokens}",
            field="skip_first_n_tokens",
        )
    skip_left = skip_first_n_tokens // kv.block_size
    written: set[int] = set()
    plans: list[ChunkPlan] = []
    for i, (ids, chunk) in enumerate(zip(block_ids, chunks, strict=True)):
        num_tokens = check_chunk_tensor(kv, chunk, f"{chunks_field}[{i}]")
        field = f"block_ids[{i}]"
        all_ids = _normalize_ids(ids, field)
        need = blocks_for_tokens(num_tokens, kv.block_size)
        if len(all_ids) < need:
            raise InvalidArgument(
                f"too few block ids for chunk {i}: {num_tokens} tokens at block_size "
                f"{kv.block_size} need {need}, got {len(all_ids)}",
                field=field,
                reason="TOO_FEW_BLOCK_IDS",
            )
        used = tuple(all_ids[:need])
        for b in used:
            if not 0 <= b < kv.num_blocks:
                raise InvalidArgument(
                    f"block id {b} in chunk {i} is outside [0, {kv.num_blocks})",
                    field=field,
                    reason="BLOCK_ID_OUT_OF_RANGE",
                )
        skip = min(skip_left, need)
        skip_left -= skip
        if forbid_duplicates:
            for b in used[skip:]:
                if b in written:
                    raise InvalidArgument(
                        f"block id {b} is written twice by this scatter (chunk {i})",
                        field=field,
                        reason="DUPLICATE_BLOCK_ID",
                    )
                written.add(b)
        plans.append(ChunkPlan(num_tokens, used, skip, chunk))
    return plans


def planes_contiguous(chunk: torch.Tensor) -> bool:
    """True when each ``chunk[plane, layer]`` is contiguous: the chunk may be a slice of a
    larger chunk's layers (kernels/layer_range.py), which the per-layer kernels take as is."""
    _, _, tokens, hidden = chunk.shape
    return (hidden == 1 or chunk.stride(3) == 1) and (tokens == 1 or chunk.stride(2) == hidden)
