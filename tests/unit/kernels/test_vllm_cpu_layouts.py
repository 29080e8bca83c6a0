"""vLLM's CPU layouts: the tile kernels against the reference, and both against vLLM itself.

``VLLM_CPU_AMX`` tiles 16 tokens and 16 dims, so it has a grid of its own
(the shared grid of ``test_kernels_ops.py`` uses 8-dim heads). ``VLLM_CPU``
runs on the same grid too: its native kernel transposes K in squares of 8
tokens by 8 dims, and these shapes give it whole squares and tails. The last tests
write K/V through vLLM's own ``cpu_attn_reshape_and_cache`` (the op vLLM's
CPU attention stores with) and read them back with kvmesh's kernels: the
ground truth for both layouts. They run where vLLM is installed (CI installs
it; without it they fail under KVMESH_REQUIRE_SERVICES=1), the AMX one only
on a CPU with AMX tiles.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvmesh.kernels import (
    KVLayoutKind,
    PagedKVCache,
    gather_chunks,
    native,
    paged_layer_shape,
    ref_gather_chunks,
    ref_scatter_chunks,
    scatter_chunks,
)
from kvmesh.kernels.vllm_cpu import head_offsets
from tests.support.servers import require_vllm

AMX = KVLayoutKind.VLLM_CPU_AMX
DTYPES = [torch.bfloat16, torch.float32]
#: (block_size, head_dim)
SHAPES = [(16, 16), (32, 64)]
#: (blocks per chunk, tokens the second chunk is short)
CHUNKS = [(2, 0), (2, 5), (1, 15)]
SKIPS = [0, 1, 3]  # blocks (plus 3 tokens) the scatter leaves alone
NUM_BLOCKS = 10
KV_HEADS = 2


@pytest.fixture(params=["native", "torch"], autouse=True)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the native tile kernel and with the torch fallback."""
    if request.param == "native":
        if native.load() is None:
            pytest.fail(f"the native kernel did not load: {native.status()}", pytrace=False)
    else:
        monkeypatch.setenv("KVMESH_NATIVE_COPY", "0")
    return str(request.param)


def make_cache(
    kind: KVLayoutKind, dtype: torch.dtype, bs: int, hd: int, seed: int = 0
) -> PagedKVCache:
    shape = paged_layer_shape(kind, NUM_BLOCKS, bs, KV_HEADS, hd)
    gen = torch.Generator().manual_seed(seed)
    return PagedKVCache([torch.randn(shape, generator=gen).to(dtype) for _ in range(2)], kind)


def chunks_for(kv: PagedKVCache, blocks: int, short: int) -> tuple[list[list[int]], list[int]]:
    ids = torch.randperm(kv.num_blocks, generator=torch.Generator().manual_seed(1))
    full = blocks * kv.block_size
    return [ids[:blocks].tolist(), ids[blocks : 2 * blocks].tolist()], [full, full - short]


def test_amx_offsets_follow_the_documented_formula() -> None:
    """Pin the offsets to the text of common.proto's KV_LAYOUT_KIND_VLLM_CPU_AMX."""
    kv = make_cache(AMX, torch.float32, 32, 32)
    offsets = head_offsets(kv)
    bs, hd = 32, 32
    for t, d in itertools.product(range(bs), range(hd)):
        k = (t // 16) * 16 * hd + (d // 2) * 32 + (t % 16) * 2 + d % 2
        v = bs * hd + (d // 16) * 16 * bs + (t // 2) * 32 + (d % 16) * 2 + t % 2
        assert (int(offsets[0, t, d]), int(offsets[1, t, d])) == (k, v)
    # Every element of the (block, head) region is K or V of exactly one (token, dim).
    assert sorted(offsets.reshape(-1).tolist()) == list(range(2 * bs * hd))


TILED = [AMX, KVLayoutKind.VLLM_CPU]


@pytest.mark.parametrize(
    ("kind", "dtype", "shape", "chunk"), itertools.product(TILED, DTYPES, SHAPES, CHUNKS)
)
def test_tile_gather_matches_the_reference(
    kind: KVLayoutKind, dtype: torch.dtype, shape: tuple[int, int], chunk: tuple[int, int]
) -> None:
    kv = make_cache(kind, dtype, *shape)
    ids, tokens = chunks_for(kv, *chunk)
    fast = [torch.zeros(kv.chunk_shape(n), dtype=dtype) for n in tokens]
    ref = [torch.zeros(kv.chunk_shape(n), dtype=dtype) for n in tokens]
    gather_chunks(kv, ids, fast)
    ref_gather_chunks(kv, ids, ref)
    assert all(torch.equal(a, b) for a, b in zip(fast, ref, strict=True))


@pytest.mark.parametrize(
    ("kind", "dtype", "shape", "chunk", "skip"),
    itertools.product(TILED, DTYPES, SHAPES, CHUNKS, SKIPS),
)
def test_tile_scatter_matches_the_reference_and_leaves_skipped_blocks(
    kind: KVLayoutKind,
    dtype: torch.dtype,
    shape: tuple[int, int],
    chunk: tuple[int, int],
    skip: int,
) -> None:
    fast_kv = make_cache(kind, dtype, *shape)
    ref_kv = make_cache(kind, dtype, *shape)
    before = [t.clone() for t in fast_kv.layers]
    ids, tokens = chunks_for(fast_kv, *chunk)
    gen = torch.Generator().manual_seed(2)
    srcs = [torch.randn(fast_kv.chunk_shape(n), generator=gen).to(dtype) for n in tokens]
    skip_tokens = min(skip * fast_kv.block_size + 3, sum(tokens))
    scatter_chunks(fast_kv, ids, srcs, skip_first_n_tokens=skip_tokens)
    ref_scatter_chunks(ref_kv, ids, srcs, skip_first_n_tokens=skip_tokens)
    assert all(torch.equal(a, b) for a, b in zip(fast_kv.layers, ref_kv.layers, strict=True))
    flat_ids = [b for row in ids for b in row]
    untouched = set(range(NUM_BLOCKS)) - set(flat_ids) | set(flat_ids[: skip_tokens // shape[0]])
    for layer, old in zip(fast_kv.layers, before, strict=True):
        for block in untouched:
            assert torch.equal(layer[block], old[block])


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("kind", TILED)
def test_copies_stream_to_aligned_memory_and_store_to_the_rest(
    kind: KVLayoutKind, offset: int, backend: str
) -> None:
    # The native copies write whole lines with streaming stores when the memory they
    # write is aligned and with ordinary stores otherwise: both match the reference.
    shape = paged_layer_shape(kind, NUM_BLOCKS, 32, KV_HEADS, 64)
    gen = torch.Generator().manual_seed(4)
    numel = int(torch.Size(shape).numel())
    layers = []
    for _ in range(2):
        backing = torch.randn(numel + offset, generator=gen).to(torch.bfloat16)
        layers.append(backing[offset:].view(shape))
    fast_kv = PagedKVCache(layers, kind)
    ref_kv = PagedKVCache([t.clone() for t in layers], kind)
    assert (layers[0].data_ptr() % 32 == 0) is (offset == 0)
    ids, tokens = chunks_for(fast_kv, 2, 3)
    srcs = [torch.randn(fast_kv.chunk_shape(n), generator=gen).to(torch.bfloat16) for n in tokens]
    scatter_chunks(fast_kv, ids, srcs)
    ref_scatter_chunks(ref_kv, ids, srcs)
    assert all(torch.equal(a, b) for a, b in zip(fast_kv.layers, ref_kv.layers, strict=True))
    # The gather streams into aligned chunks in the same way.
    outs = []
    for n in tokens:
        size = int(torch.Size(fast_kv.chunk_shape(n)).numel())
        outs.append(torch.zeros(size + offset, dtype=torch.bfloat16)[offset:].view(
            fast_kv.chunk_shape(n)))  # fmt: skip
    gather_chunks(fast_kv, ids, outs)
    want = [torch.zeros(fast_kv.chunk_shape(n), dtype=torch.bfloat16) for n in tokens]
    ref_gather_chunks(ref_kv, ids, want)
    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))


@pytest.mark.parametrize("kind", TILED)
def test_a_batch_cut_into_many_pieces_over_two_threads_matches_the_reference(
    kind: KVLayoutKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pieces of one byte: every (chunk, layer) copy is a piece of its own, pulled by the
    # calling thread and a helper; the result must not depend on who ran which.
    from kvmesh.kernels import parallel, set_copy_threads, vllm_cpu

    monkeypatch.setattr(vllm_cpu, "_PIECE_BYTES", 1)
    monkeypatch.setattr(parallel, "MIN_PARALLEL_BYTES", 0)
    set_copy_threads(2)
    try:
        fast_kv = make_cache(kind, torch.bfloat16, 32, 64)
        ref_kv = make_cache(kind, torch.bfloat16, 32, 64)
        ids, tokens = chunks_for(fast_kv, 2, 5)
        gen = torch.Generator().manual_seed(5)
        srcs = [
            torch.randn(fast_kv.chunk_shape(n), generator=gen).to(torch.bfloat16) for n in tokens
        ]
        scatter_chunks(fast_kv, ids, srcs, skip_first_n_tokens=35)
        ref_scatter_chunks(ref_kv, ids, srcs, skip_first_n_tokens=35)
        assert all(torch.equal(a, b) for a, b in zip(fast_kv.layers, ref_kv.layers, strict=True))
        outs = [torch.zeros(fast_kv.chunk_shape(n), dtype=torch.bfloat16) for n in tokens]
        want = [torch.zeros(fast_kv.chunk_shape(n), dtype=torch.bfloat16) for n in tokens]
        gather_chunks(fast_kv, ids, outs)
        ref_gather_chunks(ref_kv, ids, want)
        assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
    finally:
        set_copy_threads(None)


def test_amx_needs_16_token_and_16_dim_tiles() -> None:
    from kvmesh.common.errors import InvalidArgument

    layer = torch.zeros(paged_layer_shape(AMX, 4, 16, 2, 8), dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument, match="multiples of 16"):
        PagedKVCache([layer], AMX)


# ---- ground truth: vLLM's own store op -----------------------------------------------------


ISAS = [
    pytest.param(KVLayoutKind.VLLM_CPU, "vec", id="vec"),
    pytest.param(
        AMX,
        "amx",
        id="amx",
        marks=pytest.mark.skipif(
            not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles"
        ),
    ),
]


@pytest.mark.parametrize(("kind", "isa"), ISAS)
def test_kvmesh_reads_and_writes_what_vllm_stores(kind: KVLayoutKind, isa: str) -> None:
    """K/V stored by vLLM's op are gathered exactly; scattering them back writes the same bytes."""
    require_vllm()
    from vllm import _custom_ops as ops

    bs, heads, hd, tokens = 128, 2, 64, 256
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(tokens, heads, hd, generator=gen).to(torch.bfloat16)
    values = torch.randn(tokens, heads, hd, generator=gen).to(torch.bfloat16)

    def vllm_store(blocks: list[int]) -> torch.Tensor:
        layer = torch.zeros(paged_layer_shape(kind, 6, bs, heads, hd), dtype=torch.bfloat16)
        k_cache, v_cache = layer.view(6, heads, 2 * bs, hd).chunk(2, dim=2)
        slots = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in blocks])
        ops.cpu_attn_reshape_and_cache(
            keys, values, k_cache, v_cache, slots, isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip
        return layer

    stored = PagedKVCache([vllm_store([4, 1])], kind)
    chunk = torch.zeros(stored.chunk_shape(tokens), dtype=torch.bfloat16)
    gather_chunks(stored, [[4, 1]], [chunk])
    assert torch.equal(chunk[0, 0].view(tokens, heads, hd), keys)
    assert torch.equal(chunk[1, 0].view(tokens, heads, hd), values)

    loaded = PagedKVCache([torch.zeros_like(stored.layers[0])], kind)
    scatter_chunks(loaded, [[2, 5]], [chunk])
    assert torch.equal(loaded.layers[0], vllm_store([2, 5]))
