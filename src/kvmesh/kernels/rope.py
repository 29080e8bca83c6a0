"""Rotary position embedding (RoPE) and re-RoPE: moving cached keys to a new position.

A key computed at position ``p`` is the raw key rotated, pair by pair, by the
angle ``p * inv_freq``. Rotating it again by ``(q - p) * inv_freq`` gives the key
at position ``q``: exact in real arithmetic, and within rounding in fp32 and
bf16 (the figures are in docs/kernels.md, "Re-RoPE"). This is what lets a
document's KV, stored once, be reused after a different prefix (CacheBlend):
only the keys move; values carry no position.

The angles are computed in fp64 and the rotation in fp32 whatever the tensor's
dtype, cast back once, so a bf16 key is rounded once per re-RoPE, not once per
multiply.
"""

from __future__ import annotations

import torch

from kvmesh.kernels.rope_params import RopeParams, RopeStyle

__all__ = ["RopeParams", "RopeStyle", "apply_rope", "rerope"]


def _check(x: torch.Tensor, positions: torch.Tensor, params: RopeParams) -> None:
    if x.dim() != 3:
        raise ValueError(f"keys must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if x.shape[-1] != params.head_dim:
        raise ValueError(f"keys have head_dim {x.shape[-1]}, the RoPE params say {params.head_dim}")
    if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(
            f"positions must be [tokens] = [{x.shape[0]}], got shape {tuple(positions.shape)}"
        )
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must be integers, got {positions.dtype}")


def _rotate(x: torch.Tensor, angles: torch.Tensor, params: RopeParams) -> torch.Tensor:
    """Rotate ``x`` ([tokens, heads, head_dim]) by ``angles`` ([tokens]) times each frequency."""
    rd = params.rotary
    theta = angles.to(torch.float64)[:, None] * params.inv_freq(x.device)[None]
    cos = torch.cos(theta).to(torch.float32)[:, None, :]  # [tokens, 1, rd/2]
    sin = torch.sin(theta).to(torch.float32)[:, None, :]
    xf = x.to(torch.float32)
    rot = xf[..., :rd]
    if params.style is RopeStyle.NEOX:
        a, b = rot[..., : rd // 2], rot[..., rd // 2 :]
        turned = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    out = torch.cat((turned, xf[..., rd:]), dim=-1) if rd < params.head_dim else turned
    return out.to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, params: RopeParams) -> torch.Tensor:
    """``x`` ([tokens, heads, head_dim], raw) rotated to ``positions``; a new tensor."""
    _check(x, positions, params)
    return _rotate(x, positions, params)


def rerope(
    keys: torch.Tensor, src_positions: torch.Tensor, dst_positions: torch.Tensor, params: RopeParams
) -> torch.Tensor:
    """Keys roped at ``src_positions`` moved to ``dst_positions``; a new tensor.

    Tokens whose two positions are equal come back unchanged bit for bit.
    """
    _check(keys, src_positions, params)
    _check(keys, dst_positions, params)
    delta = dst_positions.to(torch.int64) - src_positions.to(torch.int64)
    moved = _rotate(keys, delta, params)
    same = (delta == 0)[:, None, None]
    return torch.where(same, keys, moved)
