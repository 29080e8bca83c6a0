"""Segments into and out of paged blocks with re-RoPE (kvmesh.kernels.segments).

The reference is the request computed whole: every key roped at its own
position and written by the reference scatter. Scattering a segment (keys at
0..) at ``start`` must give that cache's keys within the re-RoPE tolerance of
docs/kernels.md, its values bit for bit, and leave every other row as it was.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels.kinds import KVLayoutKind, paged_layer_shape
from kvmesh.kernels.layouts import PagedKVCache
from kvmesh.kernels.reference import ref_gather_chunks, ref_scatter_chunks
from kvmesh.kernels.rope import RopeParams, RopeStyle, apply_rope
from kvmesh.kernels.segments import gather_segment, scatter_segment

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 2, 32, 16, 12
REQUEST = 80  # tokens of the request, 5 blocks
TABLE = [7, 2, 11, 0, 5]  # its block table
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 5e-2}
KINDS = [k for k in KVLayoutKind if k is not KVLayoutKind.MLA]


def _cache(kind: KVLayoutKind, dtype: torch.dtype, seed: int = 1) -> PagedKVCache:
    g = torch.Generator().manual_seed(seed)
    shape = paged_layer_shape(kind, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    return PagedKVCache([torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)], kind)


def _snapshot(kv: PagedKVCache) -> list[torch.Tensor]:
    return [layer.clone() for layer in kv.layers]


def _request(rope: RopeParams, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw keys and values of the request's tokens ([LAYERS, REQUEST, HEADS, HEAD_DIM])."""
    g = torch.Generator().manual_seed(7)
    return (torch.randn(LAYERS, REQUEST, HEADS, HEAD_DIM, generator=g),
            torch.randn(LAYERS, REQUEST, HEADS, HEAD_DIM, generator=g).to(dtype))  # fmt: skip


def _object(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            rope: RopeParams, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """A chunk object of these tokens with the keys roped at ``positions``."""
    roped = torch.stack([apply_rope(k, positions, rope) for k in keys.to(dtype)])
    layers, n = keys.shape[:2]
    return torch.stack((roped, values)).reshape(2, layers, n, HEADS * HEAD_DIM).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("start", "n"), [(21, 37), (16, 32), (0, 80), (3, 5)])
def test_scatter_at_start_is_the_request_computed_whole(
    kind: KVLayoutKind, dtype: torch.dtype, start: int, n: int
) -> None:
    rope = RopeParams(head_dim=HEAD_DIM, base=10000.0)
    keys, values = _request(rope, dtype)
    whole = _object(keys, values, torch.arange(REQUEST), rope, dtype)
    expected = _cache(kind, dtype)
    ref_scatter_chunks(expected, [TABLE], [whole])
    # The same cache where the segment's tokens hold something else.
    kv = _cache(kind, dtype)
    wrong = whole.clone()
    wrong[:, :, start : start + n] = torch.randn(2, LAYERS, n, HEADS * HEAD_DIM).to(dtype)
    ref_scatter_chunks(kv, [TABLE], [wrong])
    segment = _object(keys[:, start : start + n], values[:, start : start + n],
                      torch.arange(n), rope, dtype)  # fmt: skip

    scatter_segment(kv, TABLE, segment, start, rope)

    got = torch.empty_like(whole)
    ref_gather_chunks(kv, [TABLE], [got])
    rows = slice(start, start + n)
    torch.testing.assert_close(got[0, :, rows].float(), whole[0, :, rows].float(),
                               atol=TOLERANCE[dtype], rtol=0)  # fmt: skip
    assert torch.equal(got[1, :, rows], whole[1, :, rows])  # values carry no position
    outside = torch.ones(REQUEST, dtype=torch.bool)
    outside[rows] = False
    assert torch.equal(got[:, :, outside], wrong[:, :, outside])
    unused = [b for b in range(NUM_BLOCKS) if b not in TABLE]
    fresh = _cache(kind, dtype)
    for layer, before in zip(kv.layers, fresh.layers, strict=True):
        for b in unused:  # blocks of other requests: untouched
            index = (slice(None), b) if kind is KVLayoutKind.FLASH_ATTN else (b,)
            assert torch.equal(layer[index], before[index])


@pytest.mark.parametrize("style", list(RopeStyle))
@pytest.mark.parametrize("kind", KINDS)
def test_gather_rotates_back_to_zero_and_round_trips(kind: KVLayoutKind, style: RopeStyle) -> None:
    rope = RopeParams(head_dim=HEAD_DIM, base=500.0, rotary_dim=16, style=style)
    keys, values = _request(rope, torch.float32)
    whole = _object(keys, values, torch.arange(REQUEST), rope, torch.float32)
    kv = _cache(kind, torch.float32)
    ref_scatter_chunks(kv, [TABLE], [whole])
    start, n = 29, 40
    out = torch.empty(kv.chunk_shape(n))
    gather_segment(kv, TABLE, out, start, rope)
    at_zero = _object(keys[:, start : start + n], values[:, start : start + n],
                      torch.arange(n), rope, torch.float32)  # fmt: skip
    torch.testing.assert_close(out, at_zero, atol=TOLERANCE[torch.float32], rtol=0)
    assert torch.equal(out[1], at_zero[1])
    # Scattered at another position of another request, it is that request's K/V there.
    table, at = [3, 9, 1, 4], 17
    scatter_segment(kv, table, out, at, rope)
    back = torch.empty(kv.chunk_shape(n))
    gather_segment(kv, table, back, at, rope)
    torch.testing.assert_close(back, at_zero, atol=2 * TOLERANCE[torch.float32], rtol=0)


def test_a_segment_already_at_its_position_moves_bit_for_bit() -> None:
    rope = RopeParams(head_dim=HEAD_DIM)
    kv = _cache(KVLayoutKind.FLASH_ATTN, torch.bfloat16)
    segment = torch.randn(kv.chunk_shape(32)).to(torch.bfloat16)
    scatter_segment(kv, TABLE, segment, 0, rope)  # start 0: no rotation at all
    got = torch.empty_like(segment)
    ref_gather_chunks(kv, [TABLE[:2]], [got])
    assert torch.equal(got, segment)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda kv, seg, rope: scatter_segment(kv, TABLE, seg, -1, rope), "start must be"),
        (lambda kv, seg, rope: scatter_segment(kv, TABLE[:2], seg, 20, rope), "need 3"),
        (lambda kv, seg, rope: scatter_segment(kv, [0, 99, 1], seg, 20, rope), "outside"),
        (lambda kv, seg, rope: scatter_segment(kv, [4, 1, 1], seg, 20, rope), "twice"),
        (lambda kv, seg, rope: scatter_segment(kv, TABLE, seg.float(), 0, rope), "dtype"),
        (lambda kv, seg, rope: scatter_segment(kv, TABLE, seg[:1], 0, rope), "shape"),
        (
            lambda kv, seg, rope: scatter_segment(kv, TABLE, seg, 0, RopeParams(head_dim=64)),
            "head_dim 64",
        ),
        (lambda kv, seg, rope: gather_segment(kv, TABLE[:1], seg, 5, rope), "need 2"),
    ],
)
def test_bad_calls_are_refused_before_any_write(call, message) -> None:  # type: ignore[no-untyped-def]
    kv = _cache(KVLayoutKind.FLASH_ATTN, torch.bfloat16)
    before = _snapshot(kv)
    segment = torch.randn(kv.chunk_shape(20)).to(torch.bfloat16)
    with pytest.raises(InvalidArgument, match=message):
        call(kv, segment, RopeParams(head_dim=HEAD_DIM))
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, before, strict=True))


def test_mla_is_refused() -> None:
    shape = paged_layer_shape(KVLayoutKind.MLA, NUM_BLOCKS, BLOCK, 1, HEAD_DIM)
    kv = PagedKVCache([torch.zeros(shape) for _ in range(LAYERS)], KVLayoutKind.MLA)
    with pytest.raises(InvalidArgument, match="MLA"):
        scatter_segment(kv, TABLE, torch.zeros(kv.chunk_shape(4)), 0, RopeParams(HEAD_DIM))
