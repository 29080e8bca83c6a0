"""RoPE and re-RoPE (kvmesh.kernels.rope) against independent references.

The NEOX reference is HF Llama's ``x * cos + rotate_half(x) * sin``; the GPT-J
reference multiplies adjacent pairs as complex numbers. Re-RoPE must satisfy
rope(k, q) == rerope(rope(k, p), p, q) within the tolerances in docs/kernels.md.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.rope import RopeParams, RopeStyle, apply_rope, rerope


def _hf_llama_rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = pos.to(torch.float64)[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    xd = x.to(torch.float64)
    half = torch.cat((-xd[..., d // 2 :], xd[..., : d // 2]), dim=-1)
    return xd * cos + half * sin


def _gptj_rope(x: torch.Tensor, pos: torch.Tensor, base: float, rd: int) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    theta = pos.to(torch.float64)[:, None] * inv[None]
    xd = x.to(torch.float64)
    pairs = torch.complex(xd[..., :rd:2], xd[..., 1:rd:2])
    turned = pairs * torch.polar(torch.ones_like(theta), theta)[:, None, :]
    out = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    return torch.cat((out, xd[..., rd:]), dim=-1)


def _keys(tokens: int = 96, heads: int = 3, head_dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, head_dim, generator=g)


def test_neox_matches_hf_llama() -> None:
    k = _keys()
    pos = torch.arange(5, 5 + k.shape[0])
    got = apply_rope(k, pos, RopeParams(head_dim=64, base=10000.0))
    torch.testing.assert_close(got.double(), _hf_llama_rope(k, pos, 10000.0), atol=1e-5, rtol=1e-5)


def test_gptj_partial_rotary_matches_complex_reference() -> None:
    k = _keys(head_dim=64)
    pos = torch.arange(k.shape[0]) * 7
    params = RopeParams(head_dim=64, base=500.0, rotary_dim=32, style=RopeStyle.GPTJ)
    got = apply_rope(k, pos, params)
    torch.testing.assert_close(got.double(), _gptj_rope(k, pos, 500.0, 32), atol=1e-5, rtol=1e-5)
    # The dimensions past rotary_dim pass through untouched.
    assert torch.equal(got[..., 32:], k[..., 32:])


@pytest.mark.parametrize("style", list(RopeStyle))
@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)],
)
def test_rerope_equals_rope_at_the_new_position(
    style: RopeStyle, dtype: torch.dtype, atol: float
) -> None:
    params = RopeParams(head_dim=64, base=100000.0, style=style)
    raw = _keys()
    src = torch.arange(raw.shape[0]) + 37  # the document stored after a 37-token prefix
    dst = torch.arange(raw.shape[0]) + 4100  # reused 4100 tokens into another prompt
    stored = apply_rope(raw.to(dtype), src, params)
    moved = rerope(stored, src, dst, params)
    if style is RopeStyle.NEOX:
        want = _hf_llama_rope(raw, dst, 100000.0)
    else:
        want = _gptj_rope(raw, dst, 100000.0, 64)
    assert moved.dtype == dtype
    # |k| ~ 1 per element: bf16 keeps 8 bits of mantissa, two roundings (store, move).
    torch.testing.assert_close(moved.double(), want, atol=atol, rtol=0.0)
    # Moving back returns the stored keys (the same rounding bound).
    back = rerope(moved, dst, src, params)
    torch.testing.assert_close(back.double(), stored.double(), atol=atol, rtol=0.0)


def test_rerope_per_token_shifts_and_zero_shift_is_bit_exact() -> None:
    params = RopeParams(head_dim=64)
    raw = _keys(tokens=8)
    src = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13])
    dst = torch.tensor([0, 1, 2, 3, 40, 41, 2, 3])  # two segments, one left in place
    stored = apply_rope(raw.to(torch.bfloat16), src, params)
    moved = rerope(stored, src, dst, params)
    assert torch.equal(moved[:4], stored[:4])
    want = _hf_llama_rope(raw, dst, 10000.0)
    torch.testing.assert_close(moved.double(), want, atol=6e-2, rtol=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_dim": 0}, "head_dim must be positive"),
        ({"head_dim": 64, "base": 0.0}, "base must be positive"),
        ({"head_dim": 64, "rotary_dim": 33}, "rotary_dim must be even"),
        ({"head_dim": 64, "rotary_dim": 128}, "rotary_dim must be even"),
    ],
)
def test_bad_params_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RopeParams(**kwargs)  # type: ignore[arg-type]


def test_bad_shapes_are_refused() -> None:
    params = RopeParams(head_dim=64)
    k = _keys(tokens=4)
    with pytest.raises(ValueError, match=r"\[tokens, heads, head_dim\]"):
        apply_rope(k[0], torch.arange(4), params)
    with pytest.raises(ValueError, match="head_dim 32"):
        apply_rope(k[..., :32], torch.arange(4), params)
    with pytest.raises(ValueError, match="positions must be"):
        apply_rope(k, torch.arange(3), params)
    with pytest.raises(ValueError, match="integers"):
        rerope(k, torch.arange(4), torch.arange(4).float(), params)
