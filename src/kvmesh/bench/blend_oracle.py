"""Rows chosen with the full prefill in hand: ``kvmesh bench blend --oracle``.

CacheBlend chooses the rows to recompute from one early layer. The oracle
chooses with the answer in hand: the cached rows whose reused values deviate
most from the full prefill's, summed over every layer after the check layer
(each layer's deviations divided by their mean over the cached rows, so that
no layer outweighs the rest). It needs the full prefill first, so it is a
measurement, never a way to serve. It is not a bound either: the engine's
default rule, which weighs the deviation by the question's attention, does
better (docs/blend.md, "Benchmark").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.blend import Segment, placed_kv
from kvmesh.engine.llama import LlamaModel, SequenceKV


def oracle_name(ratio: float) -> str:
    """The arrangement's name of an oracle ratio: 0.15 -> oracle_0_15."""
    return "oracle_" + f"{ratio:g}".replace(".", "_")


def oracle_rows(
    model: LlamaModel,
    segments: Sequence[Segment],
    full_kv: SequenceKV,
    ratio: float,
    check_layer: int,
) -> list[int]:
    """The ``ratio`` share of the prompt's cached rows (its last row aside, which a blend
    always computes) whose reused values deviate most from ``full_kv``'s, the prompt
    computed whole (see the module docstring)."""
    cached = torch.tensor(
        [seg.kv is not None for seg in segments for _ in seg.tokens], dtype=torch.bool
    )
    if len(full_kv) != len(cached):
        raise ValueError(f"full_kv has {len(full_kv)} rows for a {len(cached)}-token prompt")
    keep = round(ratio * int(cached.sum()))
    cached[-1] = False
    rows = torch.nonzero(cached).flatten()
    keep = min(keep, rows.numel())
    if keep == 0:
        return []
    score = torch.zeros(len(cached))
    for layer in range(check_layer + 1, model.num_layers):
        reused = placed_kv(model, segments, layer).values[0]
        deviation = (full_kv.values[layer] - reused).float().pow(2).sum(dim=(1, 2))
        scale = deviation[rows].mean()
        if scale > 0:
            score += deviation / scale
    return sorted(rows[torch.topk(score[rows], keep).indices].tolist())
