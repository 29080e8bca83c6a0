"""A tiny decoder-only transformer with a paged KV cache, written for exact cache hits.

Architecture (Llama-shaped, float32, fixed seeded weights, nothing downloaded):
token embedding → N × [RMSNorm → grouped-query attention with rotary
positions → residual → RMSNorm → SwiGLU MLP → residual] → RMSNorm → LM head.

**Prefill in fixed tiles.** The prompt is processed in tiles of ``tile_size``
tokens (kvmesh's chunk size, 256) on fixed boundaries ``[t*T, (t+1)*T)``.
Every tile is computed the same way, whatever the cache held:

1. its input is the embedding of its ``T`` tokens (the last tile is padded
   with token 0 to ``T`` rows), so every matmul has the same ``[T, ...]`` shape;
2. per layer it computes Q/K/V for its ``T`` rows, writes the K/V of the rows
   the cache did not supply into their paged slots, then *gathers* the K/V of
   positions ``[0, L)`` (``L = min((t+1)*T, num_tokens)``) from the paged cache
   through the block table and runs causal attention of its ``T`` queries
   over those ``L`` keys.

**Why logits with a cache hit are bit-identical to logits without one.**
A tile's result is a pure function of (its ``T`` input tokens, the bytes of
K/V at positions ``[0, L)`` in the paged cache), computed by the same
sequence of torch ops on tensors of the same shapes — so the same kernels,
the same blocking and the same summation order. A warm run skips exactly the
tiles that lie entirely inside the cached prefix and computes every later
tile in full (a tile that is only partly cached is recomputed at full width;
it just does not write the rows the cache supplied). By induction over the
tiles: the K/V bytes a warm run reads for the cached prefix are the bytes some
earlier run computed for the same tokens with the same tiles (kvmesh copies
bytes verbatim; chunk hashes guarantee the tokens match), and every tile it
computes sees identical inputs and identical gathered K/V, so it produces
identical K/V and hidden states — and the last token's logits are computed
from an identical hidden row by the same ``[1, hidden] @ [hidden, vocab]``
product. Nothing relies on a BLAS kernel giving a row the same value in a
matrix of another shape (it need not); padded rows beyond the prompt never
reach a real row (causal mask, and they are never gathered because ``L`` stops
at the prompt's end).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the universal torch alias

logger = logging.getLogger(__name__)

#: Called after each prefill tile with (tokens done, tokens in the prompt).
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of the tiny transformer (defaults: ~3 s cold prefill of 8 k tokens on 2 cores)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 768
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 1 << 16
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` on an inconsistent configuration."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")

    @property
    def name(self) -> str:
        """A model name that changes with anything that changes the KV (dims, seed)."""
        return (
            f"kvmesh-tiny-{self.num_layers}l-{self.hidden_size}h-{self.num_heads}q"
            f"{self.num_kv_heads}kv-{self.head_dim}d-{self.intermediate_size}i-"
            f"{self.vocab_size}v-seed{self.seed}"
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers (float32)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    w_qkv: torch.Tensor  # [(H + 2K) * D, hidden]
    w_o: torch.Tensor  # [hidden, H * D]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * inter, hidden]
    w_down: torch.Tensor  # [hidden, inter]


class TinyTransformer:
    """The model: seeded weights and a tiled prefill / single-token decode over a paged cache."""

    def __init__(self, config: ModelConfig) -> None:
        config.validate()
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        c = config
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            # 1/sqrt(fan_in) keeps activations O(1) through the residual stream.
            return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=gen)
        self.layers = [
            _Layer(
                attn_norm=1.0 + 0.1 * torch.randn(c.hidden_size, generator=gen),
                w_qkv=weight(q_dim + 2 * kv_dim, c.hidden_size),
                w_o=weight(c.hidden_size, q_dim),
                mlp_norm=1.0 + 0.1 * torch.randn(c.hidden_size, generator=gen),
                w_gate_up=weight(2 * c.intermediate_size, c.hidden_size),
                w_down=weight(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = 1.0 + 0.1 * torch.randn(c.hidden_size, generator=gen)
        self.lm_head = weight(c.vocab_size, c.hidden_size)
        inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        )
        angles = torch.outer(torch.arange(c.max_position, dtype=torch.float64), inv_freq)
        self._cos = angles.cos().to(torch.float32)  # [max_position, D/2]
        self._sin = angles.sin().to(torch.float32)

    # ----------------------------------------------------------------- pieces

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.config.rms_norm_eps) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (rotate-half form) of ``x`` [T, heads, D] at ``positions`` [T]."""
        half = self.config.head_dim // 2
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @staticmethod
    def _slots(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """vLLM's slot mapping: flat row of each position in a [num_blocks * block_size] plane."""
        return block_ids[positions // block_size] * block_size + positions % block_size

    def _gather(
        self, kv_layer: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, num_tokens) from the paged layer, as [heads, tokens, D]."""
        _, _, block_size, kv_heads, head_dim = kv_layer.shape
        nb = -(-num_tokens // block_size)
        table = block_ids[:nb]
        k = kv_layer[0].index_select(0, table).view(nb * block_size, kv_heads, head_dim)
        v = kv_layer[1].index_select(0, table).view(nb * block_size, kv_heads, head_dim)
        return k[:num_tokens].transpose(0, 1), v[:num_tokens].transpose(0, 1)

    def _layer(
        self,
        layer: _Layer,
        kv_layer: torch.Tensor,
        x: torch.Tensor,
        positions: torch.Tensor,
        block_ids: torch.Tensor,
        write_rows: slice,
        num_keys: int,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        c = self.config
        t = x.shape[0]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = self._rms_norm(x, layer.attn_norm)
        qkv = h @ layer.w_qkv.T
        q = qkv[:, :q_dim].view(t, c.num_heads, c.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].view(t, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_dim + kv_dim :].view(t, c.num_kv_heads, c.head_dim)
        q = self._rope(q, positions)
        k = self._rope(k, positions)
        # Write only the rows the cache did not supply (the others may be shared blocks).
        if write_rows.stop > write_rows.start:
            slots = self._slots(block_ids, positions[write_rows], kv_layer.shape[2])
            kv_layer[0].view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slots, k[write_rows])
            kv_layer[1].view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slots, v[write_rows])
        # Attend over K/V gathered from the paged cache, never over the fresh tensors,
        # so cold and warm runs read the same bytes the same way.
        keys, values = self._gather(kv_layer, block_ids, num_keys)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=attn_mask,
            enable_gqa=True,
        )
        attn = attn.squeeze(0).transpose(0, 1).reshape(t, q_dim)
        x = x + attn @ layer.w_o.T
        h = self._rms_norm(x, layer.mlp_norm)
        gate, up = (h @ layer.w_gate_up.T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ layer.w_down.T

    def _logits(self, hidden_row: torch.Tensor) -> torch.Tensor:
        return (self._rms_norm(hidden_row, self.final_norm) @ self.lm_head.T).squeeze(0)

    def _check_cache(self, kv_caches: Sequence[torch.Tensor]) -> int:
        c = self.config
        if len(kv_caches) != c.num_layers:
            raise ValueError(f"{len(kv_caches)} KV layers for a {c.num_layers}-layer model")
        shape = tuple(kv_caches[0].shape)
        if (
            len(shape) != 5
            or shape[0] != 2
            or shape[3:] != (c.num_kv_heads, c.head_dim)
            or kv_caches[0].dtype != torch.float32
        ):
            raise ValueError(
                f"KV layers must be float32 [2, num_blocks, block_size, {c.num_kv_heads}, "
                f"{c.head_dim}], got {kv_caches[0].dtype} {shape}"
            )
        return int(shape[2])

    # ----------------------------------------------------------------- public

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        *,
        num_computed_tokens: int = 0,
        tile_size: int = 256,
        on_progress: ProgressFn | None = None,
    ) -> torch.Tensor:
        """Prefill a prompt whose first ``num_computed_tokens`` tokens' K/V are in the cache.

        Computes the tiles from the one holding token ``num_computed_tokens``
        to the end (see the module docstring), writes the K/V of tokens
        ``[num_computed_tokens, len)`` into the paged cache and returns the
        logits of the last prompt token, shape ``[vocab_size]``.
        ``block_ids`` is the request's block table (enough blocks for the
        prompt). At least the last token is always computed.
        """
        n = len(token_ids)
        block_size = self._check_cache(kv_caches)
        if n == 0:
            raise ValueError("empty prompt")
        if n + tile_size > self.config.max_position:
            raise ValueError(f"prompt of {n} tokens exceeds max_position")
        if not 0 <= num_computed_tokens < n:
            raise ValueError(f"num_computed_tokens must be in [0, {n}), got {num_computed_tokens}")
        if len(block_ids) * block_size < n:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {n} tokens")
        tokens = torch.tensor(list(token_ids), dtype=torch.long)
        table = torch.tensor(list(block_ids), dtype=torch.long)
        num_tiles = -(-n // tile_size)
        logits = torch.empty(0)
        for tile in range(num_computed_tokens // tile_size, num_tiles):
            start = tile * tile_size
            end = min(start + tile_size, n)
            tile_tokens = torch.zeros(tile_size, dtype=torch.long)
            tile_tokens[: end - start] = tokens[start:end]
            positions = torch.arange(start, start + tile_size)
            # Causal over [0, end): query at position p sees keys 0..p.
            mask = torch.arange(end).unsqueeze(0) <= positions.unsqueeze(1)
            write = slice(max(num_computed_tokens, start) - start, end - start)
            x = self.embed[tile_tokens]
            for layer, kv_layer in zip(self.layers, kv_caches, strict=True):
                x = self._layer(layer, kv_layer, x, positions, table, write, end, mask)
            if end == n:
                logits = self._logits(x[n - 1 - start : n - start])
            if on_progress is not None:
                on_progress(end, n)
        return logits

    @torch.inference_mode()
    def decode(
        self,
        token_id: int,
        position: int,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
    ) -> torch.Tensor:
        """One decode step: K/V of ``token_id`` at ``position`` into the cache; its logits."""
        self._check_cache(kv_caches)
        table = torch.tensor(list(block_ids), dtype=torch.long)
        positions = torch.tensor([position])
        x = self.embed[torch.tensor([token_id])]
        for layer, kv_layer in zip(self.layers, kv_caches, strict=True):
            x = self._layer(layer, kv_layer, x, positions, table, slice(0, 1), position + 1, None)
        return self._logits(x)
