"""A Llama-architecture model loaded from a Hugging Face folder, run layer by layer.

kvmesh's blending engine (docs/blend.md) needs what an inference engine hides:
the K/V of every layer for chosen rows, attention of some queries over keys
that came from elsewhere, and the model's RoPE parameters. This module runs a
Llama-family checkpoint (``LlamaForCausalLM``: SmolLM2, Llama 2/3 without RoPE
scaling) in plain torch on contiguous per-sequence KV, one layer at a time:

- :meth:`LlamaModel.qkv` gives a layer's queries, keys and values for some
  rows, the keys already rotated to those rows' positions;
- :meth:`LlamaModel.attend` runs those queries over any keys and values
  (grouped-query attention, causal by position, not by row) and the rest of the
  layer (output projection, residual, MLP).

:meth:`LlamaModel.prefill` and :meth:`LlamaModel.decode` are the plain engine
built from the two. The weights are loaded from ``model.safetensors`` (or its
shards) and computed in float32 by default.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the universal torch alias

from kvmesh.kernels.rope import RopeParams, apply_rope


class ModelFolderError(ValueError):
    """A model folder that this module cannot run; the message names what is wrong."""


@dataclass(frozen=True)
class LlamaConfig:
    """The dimensions of a Llama-architecture model (from its ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaConfig:
        """Read a HF ``config.json``; :class:`ModelFolderError` for what is not plain Llama."""
        if config.get("model_type") != "llama":
            raise ModelFolderError(
                f"model_type is {config.get('model_type')!r}; only 'llama' models are supported"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ModelFolderError(f"hidden_act {config['hidden_act']!r} is not supported")
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ModelFolderError(f"{flag} is not supported")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling")
        kind = rope.get("rope_type", "default")
        if scaling or kind != "default":
            raise ModelFolderError(f"RoPE scaling ({scaling or kind}) is not supported")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            built = cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads", heads)),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise ModelFolderError(f"config.json has no {exc.args[0]}") from None
        if built.num_heads % built.num_kv_heads:
            raise ModelFolderError(
                f"{built.num_heads} attention heads are not a multiple of "
                f"{built.num_kv_heads} KV heads"
            )
        return built

    @property
    def rope(self) -> RopeParams:
        """The RoPE parameters, as an engine registers them with its KV."""
        return RopeParams(head_dim=self.head_dim, base=self.rope_theta)


@dataclass
class SequenceKV:
    """K/V of a run of tokens: per layer ``[tokens, kv_heads, head_dim]``, keys roped."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def __len__(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    def slice(self, start: int, end: int) -> SequenceKV:
        """Rows ``[start, end)`` of every layer (views)."""
        return SequenceKV([k[start:end] for k in self.keys], [v[start:end] for v in self.values])

    @staticmethod
    def cat(parts: Sequence[SequenceKV]) -> SequenceKV:
        """The parts one after another (new tensors)."""
        layers = range(len(parts[0].keys))
        return SequenceKV(
            [torch.cat([p.keys[layer] for p in parts]) for layer in layers],
            [torch.cat([p.values[layer] for p in parts]) for layer in layers],
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = folder / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        raise ModelFolderError(f"{folder} has no model.safetensors (nor its index)")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(folder / shard)))
    return weights


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class LlamaModel:
    """A loaded Llama model (inference only, no autograd)."""

    def __init__(
        self, config: LlamaConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> None:
        self.config = config
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            try:
                return weights[name].to(dtype).contiguous()
            except KeyError:
                raise ModelFolderError(f"the weights have no {name}") from None

        self.embed_tokens = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        head = "lm_head.weight"
        tied = config.tie_word_embeddings or head not in weights
        self.lm_head = self.embed_tokens if tied else take(head)
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    input_norm=take(p + "input_layernorm.weight"),
                    q=take(p + "self_attn.q_proj.weight"),
                    k=take(p + "self_attn.k_proj.weight"),
                    v=take(p + "self_attn.v_proj.weight"),
                    o=take(p + "self_attn.o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate=take(p + "mlp.gate_proj.weight"),
                    up=take(p + "mlp.up_proj.weight"),
                    down=take(p + "mlp.down_proj.weight"),
                )
            )
        self.rope = config.rope
        self._scale = 1.0 / math.sqrt(config.head_dim)

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> LlamaModel:
        """Load ``folder`` (``config.json`` and safetensors weights)."""
        folder = Path(folder)
        try:
            config = json.loads((folder / "config.json").read_text())
        except OSError as exc:
            raise ModelFolderError(f"{folder}: no readable config.json ({exc})") from None
        return cls(LlamaConfig.from_hf(config), _load_weights(folder), dtype)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.rms_norm_eps) * weight

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        """``[rows, hidden]`` input of the first layer."""
        ids = torch.tensor(list(tokens), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        return self.embed_tokens[ids]

    @torch.inference_mode()
    def qkv(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s (queries, keys, values) of ``hidden``'s rows, q and k roped."""
        w = self.layers[layer]
        c = self.config
        x = self._rms(hidden, w.input_norm)
        rows = x.shape[0]
        q = (x @ w.q.T).view(rows, c.num_heads, c.head_dim)
        k = (x @ w.k.T).view(rows, c.num_kv_heads, c.head_dim)
        v = (x @ w.v.T).view(rows, c.num_kv_heads, c.head_dim)
        return apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope), v

    @torch.inference_mode()
    def attend(
        self,
        layer: int,
        hidden: torch.Tensor,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> torch.Tensor:
        """The rest of layer ``layer`` for ``hidden``'s rows: their next hidden states.

        A query at position p sees the keys at positions <= p.
        """
        c = self.config
        group = c.num_heads // c.num_kv_heads
        q = queries.transpose(0, 1)  # [heads, rows, head_dim]
        k = keys.repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.repeat_interleave(group, dim=1).transpose(0, 1)
        mask = key_positions[None, :] <= query_positions[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self._scale)
        return self.finish(layer, hidden, out.transpose(0, 1))

    @torch.inference_mode()
    def finish(self, layer: int, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of layer ``layer`` after attention (``attended``: ``[rows, heads,
        head_dim]``): output projection, MLP, residuals; the rows' next hidden states."""
        w = self.layers[layer]
        c = self.config
        hidden = hidden + attended.reshape(hidden.shape[0], c.num_heads * c.head_dim) @ w.o.T
        x = self._rms(hidden, w.post_norm)
        return hidden + (F.silu(x @ w.gate.T) * (x @ w.up.T)) @ w.down.T

    @torch.inference_mode()
    def read_attention(
        self,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention as in :meth:`attend`, with its weights: ``(attended [rows, heads,
        head_dim], weights [rows, key rows])``, the weights averaged over the heads.

        An explicit softmax, so equal to :meth:`attend`'s within rounding, not bit
        for bit. Each KV head's query heads are grouped, so K/V are not repeated.
        """
        c = self.config
        group = c.num_heads // c.num_kv_heads
        rows = queries.shape[0]
        # [kv_heads, group * rows, head_dim]: query head h reads KV head h // group.
        q = queries.view(rows, c.num_kv_heads, group, c.head_dim).permute(1, 2, 0, 3)
        q = q.reshape(c.num_kv_heads, group * rows, c.head_dim)
        scores = (q @ keys.permute(1, 2, 0)) * self._scale  # [kv_heads, group * rows, keys]
        scores = scores.view(c.num_kv_heads, group, rows, -1)
        hidden_keys = key_positions[None, :] > query_positions[:, None]
        probs = torch.softmax(scores.masked_fill(hidden_keys, float("-inf")), dim=-1)
        out = probs.view(c.num_kv_heads, group * rows, -1) @ values.transpose(0, 1)
        out = out.view(c.num_kv_heads, group, rows, c.head_dim).permute(2, 0, 1, 3)
        return out.reshape(rows, c.num_heads, c.head_dim), probs.mean(dim=(0, 1))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]`` float32 logits of final hidden states."""
        return (self._rms(hidden, self.norm) @ self.lm_head.T).float()

    @torch.inference_mode()
    def prefill(
        self, tokens: Sequence[int], past: SequenceKV | None = None
    ) -> tuple[torch.Tensor, SequenceKV]:
        """Run ``tokens`` after ``past`` (a cached prefix, or nothing).

        Returns the last token's logits (``[vocab]``) and the K/V of past + tokens.
        """
        if not tokens:
            raise ValueError("prefill needs at least one token")
        start = len(past) if past is not None else 0
        positions = torch.arange(start, start + len(tokens))
        all_positions = torch.arange(start + len(tokens))
        hidden = self.embed(tokens)
        keys, values = [], []
        for layer in range(self.num_layers):
            q, k, v = self.qkv(layer, hidden, positions)
            if past is not None and start:
                k = torch.cat((past.keys[layer], k))
                v = torch.cat((past.values[layer], v))
            keys.append(k)
            values.append(v)
            hidden = self.attend(layer, hidden, q, positions, k, v, all_positions)
        return self.logits(hidden[-1:])[0], SequenceKV(keys, values)

    @torch.inference_mode()
    def decode(self, token: int, kv: SequenceKV) -> tuple[torch.Tensor, SequenceKV]:
        """One token after ``kv``: its logits and the K/V with it appended."""
        return self.prefill([token], kv)

    @torch.inference_mode()
    def generate(self, first_logits: torch.Tensor, kv: SequenceKV, max_tokens: int) -> list[int]:
        """Greedy tokens from the prompt's last logits on (``max_tokens`` of them)."""
        out: list[int] = []
        logits = first_logits
        for _ in range(max_tokens):
            token = int(torch.argmax(logits))
            out.append(token)
            if len(out) == max_tokens:
                break
            logits, kv = self.decode(token, kv)
        return out
