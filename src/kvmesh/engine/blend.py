"""CacheBlend's selective recompute: a prompt's prefill that reuses documents' K/V anywhere.

A prompt is a list of :class:`Segment` s (a system prompt, documents in any
order, a question). A segment may carry K/V computed earlier for its tokens
alone, at other positions (``source_start``) and after another context. Its
keys are moved to where the segment now sits (re-RoPE, docs/kernels.md,
"Re-RoPE"); its values carry no position. What such reuse lacks is the
attention of each document to the ones now before it, and CacheBlend restores
the part of it that matters (docs/blend.md, "Selective recompute"):

1. layers ``0 .. check_layer`` are computed for every row, as a full prefill
   does;
2. at ``check_layer`` the ``recompute_ratio`` share of cached rows that matter
   most stays *active*, with every row that had no cached K/V and the last row.
   ``selection="deviation"`` is CacheBlend's rule: the rows whose fresh values
   deviate most from the cached ones. ``selection="attention"`` (the default)
   weighs that deviation by the attention the always-computed rows (the
   question) pay each row in the later layers, read off a probe that runs
   only those rows over the reused K/V;
3. in later layers only the active rows are computed: their fresh K/V replace
   the cached rows' (reused as they are) and their queries attend over all of it.

Ratio 1.0 keeps every row active: the same operations on the same shapes as
:meth:`~kvmesh.engine.llama.LlamaModel.prefill`, so the logits and K/V are those
of a full prefill bit for bit. Ratio 0 reuses every cached row after the check
layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engine.llama import LlamaModel, SequenceKV
from kvmesh.kernels.rope import rerope

#: How the rows to recompute are chosen (see the module docstring).
SELECTIONS = ("attention", "deviation")


@dataclass(frozen=True)
class Segment:
    """Tokens of the prompt, with the K/V computed for them earlier (or none).

    ``kv`` has one row per token; its keys were roped at positions
    ``source_start, source_start + 1, ...``.
    """

    tokens: Sequence[int]
    kv: SequenceKV | None = None
    source_start: int = 0


@dataclass
class BlendResult:
    """A blended prefill: the last token's logits and the prompt's K/V."""

    logits: torch.Tensor
    kv: SequenceKV
    #: Rows whose cached K/V was kept after the check layer.
    reused_tokens: int
    #: Cached rows recomputed (the deviation's top share, and a cached last token).
    recomputed_tokens: int
    #: Rows with no cached K/V (always computed).
    computed_tokens: int
    #: The cached rows recomputed (prompt positions, ascending).
    recomputed_rows: list[int]

    @property
    def num_tokens(self) -> int:
        return self.reused_tokens + self.recomputed_tokens + self.computed_tokens


def _check(
    model: LlamaModel,
    segments: Sequence[Segment],
    recompute_ratio: float,
    check_layer: int,
    selection: str,
) -> None:
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    if not segments:
        raise ValueError("a blend needs at least one segment")
    if not 0.0 <= recompute_ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
    if not 0 <= check_layer < model.num_layers:
        raise ValueError(f"check_layer must be in [0, {model.num_layers}), got {check_layer}")
    for i, seg in enumerate(segments):
        if not seg.tokens:
            raise ValueError(f"segment {i} has no tokens")
        if seg.source_start < 0:
            raise ValueError(f"segment {i}: source_start must be >= 0, got {seg.source_start}")
        if seg.kv is None:
            continue
        if len(seg.kv.keys) != model.num_layers or len(seg.kv.values) != model.num_layers:
            raise ValueError(
                f"segment {i}: K/V of {len(seg.kv.keys)} layers "
                f"for a {model.num_layers}-layer model"
            )
        if len(seg.kv) != len(seg.tokens):
            raise ValueError(f"segment {i}: {len(seg.kv)} K/V rows for {len(seg.tokens)} tokens")


def blend_prefill(
    model: LlamaModel,
    segments: Sequence[Segment],
    recompute_ratio: float,
    check_layer: int = 1,
    *,
    selection: str = "attention",
    recompute_rows: Sequence[int] | None = None,
) -> BlendResult:
    """The prompt ``segments`` prefilled with CacheBlend (see the module's docstring).

    ``selection``: how the rows to recompute are chosen, one of :data:`SELECTIONS`.
    ``recompute_rows``: the cached rows (prompt positions) to recompute after the
    check layer, chosen by the caller instead (to measure a selection rule against
    the others); ``recompute_ratio`` and ``selection`` are then only checked.
    """
    _check(model, segments, recompute_ratio, check_layer, selection)
    blend = _Blend(model, segments)
    if recompute_rows is not None:
        bad = [r for r in recompute_rows if not 0 <= r < blend.n]
        if bad:
            raise ValueError(f"recompute_rows outside the prompt's {blend.n} rows: {bad[:5]}")
        blend.chosen = torch.tensor(sorted(set(recompute_rows)), dtype=torch.long)
    return blend.run(recompute_ratio, check_layer, selection)


def placed_kv(model: LlamaModel, segments: Sequence[Segment], layer: int) -> SequenceKV:
    """Layer ``layer``'s cached K/V of the prompt where its segments now sit: keys moved
    to the prompt's positions, values as they are, zero rows for uncached segments."""
    blend = _Blend(model, segments)
    return SequenceKV([blend._old(layer, values=False)], [blend._old(layer, values=True)])


class _Blend:
    def __init__(self, model: LlamaModel, segments: Sequence[Segment]) -> None:
        self.model = model
        self.segments = segments
        self.tokens = [t for seg in segments for t in seg.tokens]
        self.n = len(self.tokens)
        cached = []
        for seg in segments:
            cached += [seg.kv is not None] * len(seg.tokens)
        self.cached = torch.tensor(cached, dtype=torch.bool)
        #: Cached rows to recompute, when the caller chose them (else the selection rule).
        self.chosen: torch.Tensor | None = None
        #: Per layer, the cached keys moved to the prompt's positions by the attention
        #: probe, taken (and dropped) by the blend's own pass over the same layer.
        self._moved_keys: dict[int, torch.Tensor] = {}

    def _old(self, layer: int, values: bool) -> torch.Tensor:
        """Layer ``layer``'s cached values, or keys moved to the prompt's positions."""
        parts: list[torch.Tensor] = []
        at = 0
        for seg in self.segments:
            n = len(seg.tokens)
            if seg.kv is None:
                c = self.model.config
                parts.append(torch.zeros((n, c.num_kv_heads, c.head_dim), dtype=self.model.dtype))
            elif values:
                parts.append(seg.kv.values[layer].to(self.model.dtype))
            else:
                src = torch.arange(seg.source_start, seg.source_start + n)
                dst = torch.arange(at, at + n)
                keys = seg.kv.keys[layer].to(self.model.dtype)
                parts.append(rerope(keys, src, dst, self.model.rope))
            at += n
        return torch.cat(parts)

    def _select(
        self,
        layer: int,
        fresh_values: torch.Tensor,
        hidden: torch.Tensor,
        ratio: float,
        selection: str,
    ) -> torch.Tensor:
        """Sorted rows that stay active after ``layer`` (the check layer): the top
        ``ratio`` of cached rows by ``selection``'s score (or the rows the caller
        chose), every uncached row, the last row. ``hidden``: every row's output of
        ``layer``."""
        active = ~self.cached
        active[-1] = True
        if self.chosen is not None:
            active[self.chosen] = True
            return torch.nonzero(active).flatten()
        cached_rows = torch.nonzero(self.cached & ~active).flatten()
        keep = round(ratio * int(self.cached.sum()))
        keep = min(keep, cached_rows.numel())
        if keep == cached_rows.numel():
            active[cached_rows] = True
        elif keep:
            old = self._old(layer, values=True)[cached_rows]
            score = (fresh_values[cached_rows] - old).float().pow(2).sum(dim=(1, 2))
            if selection == "attention":
                always = torch.nonzero(active).flatten()
                score = score * self._attention(layer, hidden[always], always, cached_rows)
            active[cached_rows[torch.topk(score, keep).indices]] = True
        return torch.nonzero(active).flatten()

    def _attention(
        self, check_layer: int, hidden: torch.Tensor, rows: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """Per candidate row, the attention ``rows`` pay it in every layer after the check
        layer when only they are computed over the reused K/V (ratio 0's blend of them),
        each layer's share divided by its mean over the candidates, summed."""
        model = self.model
        positions = torch.arange(self.n)
        total = torch.zeros(candidates.numel())
        for layer in range(check_layer + 1, model.num_layers):
            q, k, v = model.qkv(layer, hidden, positions[rows])
            keys = self._old(layer, values=False)
            self._moved_keys[layer] = keys.clone()
            values = self._old(layer, values=True)
            keys[rows] = k
            values[rows] = v
            attended, paid = model.read_attention(q, positions[rows], keys, values, positions)
            paid = paid.mean(0)[candidates].float()
            total += paid / paid.mean().clamp_min(1e-12)
            if layer + 1 < model.num_layers:
                hidden = model.finish(layer, hidden, attended)
        return total

    @torch.inference_mode()
    def run(self, ratio: float, check_layer: int, selection: str) -> BlendResult:
        model = self.model
        positions = torch.arange(self.n)
        hidden = model.embed(self.tokens)
        active = positions
        keys, values = [], []
        for layer in range(model.num_layers):
            q, k, v = model.qkv(layer, hidden, positions[active])
            if layer > check_layer:
                old_k = self._moved_keys.pop(layer, None)
                if old_k is None:
                    old_k = self._old(layer, values=False)
                old_v = self._old(layer, values=True)
                old_k[active] = k
                old_v[active] = v
                k, v = old_k, old_v
            keys.append(k)
            values.append(v)
            hidden = model.attend(layer, hidden, q, positions[active], k, v, positions)
            if layer == check_layer:
                active = self._select(layer, v, hidden, ratio, selection)
                hidden = hidden[active]
        computed = int((~self.cached).sum())
        active_cached = int(self.cached[active].sum())
        return BlendResult(
            logits=model.logits(hidden[-1:])[0],
            kv=SequenceKV(keys, values),
            reused_tokens=int(self.cached.sum()) - active_cached,
            recomputed_tokens=active_cached,
            computed_tokens=computed,
            recomputed_rows=active[self.cached[active]].tolist(),
        )
