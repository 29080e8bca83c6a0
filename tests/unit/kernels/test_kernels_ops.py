"""The fast gather/scatter ops agree with the reference over parameter grids.

Same test bodies on CPU and, when a GPU is present, CUDA (the CUDA cases skip
only because the device is absent).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from kvmesh.kernels import (
    KVLayoutKind,
    PagedKVCache,
    copy_threads,
    gather_chunks,
    paged_layer_shape,
    ref_gather_chunks,
    ref_scatter_chunks,
    scatter_chunks,
    set_copy_threads,
)

# ---- parameter grids ------------------------------------------------------------------------
#: VLLM_CPU_AMX tiles 16 tokens and 16 dims: its grid is in test_vllm_cpu_layouts.py.
LAYOUTS = [kind for kind in KVLayoutKind if kind is not KVLayoutKind.VLLM_CPU_AMX]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BLOCK_SIZES = [1, 16]
#: (chunk tokens as a multiple of block_size, tokens of the batch's last chunk less than full)
CHUNK_CASES = [(4, 0), (4, 5), (2, 1)]
SKIPS = ["none", "one_block_plus_3", "past_first_chunk"]
STORAGE = ["fused", "per_layer"]
#: Where the copies run. CPU caches copy with NumPy by default; "cpu-torch_ops"
#: runs the torch ops that CUDA uses on CPU, so they are tested without a GPU.
TARGETS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cpu-torch_ops", id="cpu-torch_ops"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present"),
    ),
]

NUM_LAYERS = 2
NUM_BLOCKS = 12
KV_HEADS = 2
HEAD_DIM = 8


@pytest.fixture(params=TARGETS)
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The torch device of the test's cache; selects the CPU implementation too."""
    import kvmesh.kernels.ops

    if request.param == "cpu-torch_ops":
        monkeypatch.setattr(kvmesh.kernels.ops, "_CPU_BACKEND", "torch")
        return "cpu"
    return str(request.param)


def make_cache(
    kind: KVLayoutKind,
    dtype: torch.dtype,
    block_size: int,
    device: str,
    storage: str,
    *,
    num_layers: int = NUM_LAYERS,
    num_blocks: int = NUM_BLOCKS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    seed: int = 0,
) -> PagedKVCache:
    """Random paged cache; ``fused`` puts all layers in one storage, like one shm file."""
    shape = paged_layer_shape(kind, num_blocks, block_size, kv_heads, head_dim)
    gen = torch.Generator().manual_seed(seed)
    if storage == "fused":
        # A gap between layers checks that the layer offsets, not adjacency, are used.
        per_layer = int(torch.tensor(shape).prod())
        gap = block_size * (1 if kind is KVLayoutKind.MLA else kv_heads) * head_dim
        flat = torch.randn(num_layers * (per_layer + gap), generator=gen).to(dtype).to(device)
        layers = [
            flat[i * (per_layer + gap) : i * (per_layer + gap) + per_layer].view(shape)
            for i in range(num_layers)
        ]
    else:
        layers = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(num_layers)]
    cache = PagedKVCache(layers, kind)
    assert cache.fused == (storage == "fused")
    return cache


def snapshot(kv: PagedKVCache) -> list[torch.Tensor]:
    return [layer.clone() for layer in kv.layers]


def restore(kv: PagedKVCache, saved: list[torch.Tensor]) -> None:
    for layer, s in zip(kv.layers, saved, strict=True):
        layer.copy_(s)


def batch(kv: PagedKVCache, blocks_per_chunk: int, short: int) -> tuple[list[list[int]], list[int]]:
    """Two chunks of distinct, shuffled block ids; the second is ``short`` tokens short."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(kv.num_blocks, generator=gen)[: 2 * blocks_per_chunk].tolist()
    full = blocks_per_chunk * kv.block_size
    tokens = [full, full - short % full]
    return [ids[:blocks_per_chunk], ids[blocks_per_chunk:]], tokens


def skip_tokens(skip: str, kv: PagedKVCache, tokens: list[int]) -> int:
    if skip == "none":
        return 0
    if skip == "one_block_plus_3":
        return kv.block_size + 3
    return tokens[0] + kv.block_size


def random_chunks(kv: PagedKVCache, tokens: list[int], device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(kv.chunk_shape(n), generator=gen).to(kv.dtype).to(device) for n in tokens]


GRID = list(itertools.product(LAYOUTS, DTYPES, BLOCK_SIZES, CHUNK_CASES))


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(("kind", "dtype", "block_size", "chunk_case"), GRID)
def test_gather_matches_reference(
    kind: KVLayoutKind,
    dtype: torch.dtype,
    block_size: int,
    chunk_case: tuple[int, int],
    storage: str,
    device: str,
) -> None:
    kv = make_cache(kind, dtype, block_size, device, storage)
    ids, tokens = batch(kv, *chunk_case)
    before = snapshot(kv)
    outs = [torch.full(kv.chunk_shape(n), 7.0, dtype=dtype, device=device) for n in tokens]
    expected = [torch.zeros_like(o) for o in outs]

    gather_chunks(kv, ids, outs)
    ref_gather_chunks(kv, ids, expected)

    for got, want in zip(outs, expected, strict=True):
        assert torch.equal(got, want)
    # Gather only reads the cache.
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, before, strict=True))


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize(("kind", "dtype", "block_size", "chunk_case"), GRID)
def test_scatter_matches_reference(
    kind: KVLayoutKind,
    dtype: torch.dtype,
    block_size: int,
    chunk_case: tuple[int, int],
    skip: str,
    storage: str,
    device: str,
) -> None:
    kv = make_cache(kind, dtype, block_size, device, storage)
    ids, tokens = batch(kv, *chunk_case)
    srcs = random_chunks(kv, tokens, device)
    src_copies = [s.clone() for s in srcs]
    n_skip = skip_tokens(skip, kv, tokens)
    before = snapshot(kv)

    ref_scatter_chunks(kv, ids, srcs, skip_first_n_tokens=n_skip)
    expected = snapshot(kv)
    restore(kv, before)
    scatter_chunks(kv, ids, srcs, skip_first_n_tokens=n_skip)

    for got, want in zip(kv.layers, expected, strict=True):
        assert torch.equal(got, want)
    # Scatter only reads the chunks.
    assert all(torch.equal(a, b) for a, b in zip(srcs, src_copies, strict=True))


@pytest.mark.parametrize("kind", LAYOUTS)
def test_scatter_then_gather_round_trips_chunk_bytes(kind: KVLayoutKind, device: str) -> None:
    kv = make_cache(kind, torch.bfloat16, 16, device, "fused")
    ids, tokens = batch(kv, 3, 7)
    srcs = random_chunks(kv, tokens, device)
    scatter_chunks(kv, ids, srcs)
    outs = [torch.zeros_like(s) for s in srcs]
    gather_chunks(kv, ids, outs)
    for got, want in zip(outs, srcs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_scatter_writes_only_named_blocks_and_only_the_tokens_of_a_partial_block(
    kind: KVLayoutKind, device: str
) -> None:
    kv = make_cache(kind, torch.float32, 16, device, "fused")
    before = snapshot(kv)
    # 20 tokens: block 5 fully, block 9 only its first 4 tokens.
    src = random_chunks(kv, [20], device)[0]
    scatter_chunks(kv, [[5, 9, 11]], [src])

    for layer_idx, (now, was) in enumerate(zip(kv.layers, before, strict=True)):
        for block in range(kv.num_blocks):
            for plane in range(kv.kv_size):
                got = _block(kv.kind, now, plane, block)
                old = _block(kv.kind, was, plane, block)
                if block == 5:
                    want = src[plane, layer_idx, :16]
                    assert torch.equal(got, want)
                elif block == 9:
                    assert torch.equal(got[:4], src[plane, layer_idx, 16:20])
                    assert torch.equal(got[4:], old[4:])
                else:  # block 11 was named but not needed for 20 tokens
                    assert torch.equal(got, old)


def test_scatter_skip_rounds_down_to_whole_blocks(device: str) -> None:
    kv = make_cache(KVLayoutKind.FLASH_ATTN, torch.float32, 16, device, "per_layer")
    before = snapshot(kv)
    src = random_chunks(kv, [48], device)[0]
    # 19 tokens = one block and 3 tokens: only the first block is left alone.
    scatter_chunks(kv, [[2, 4, 6]], [src], skip_first_n_tokens=19)
    for layer_idx, (now, was) in enumerate(zip(kv.layers, before, strict=True)):
        for plane in range(2):
            assert torch.equal(now[plane, 2], was[plane, 2])
            assert torch.equal(_flat(now[plane, 4]), src[plane, layer_idx, 16:32])
            assert torch.equal(_flat(now[plane, 6]), src[plane, layer_idx, 32:48])


def test_skip_counts_blocks_across_chunk_boundaries(device: str) -> None:
    kv = make_cache(KVLayoutKind.FLASHINFER, torch.float16, 16, device, "fused")
    before = snapshot(kv)
    srcs = random_chunks(kv, [32, 32], device)
    # Skip 3 blocks: all of chunk 0 (blocks 1, 3) and the first block of chunk 1 (block 5).
    scatter_chunks(kv, [[1, 3], [5, 7]], srcs, skip_first_n_tokens=48)
    for now, was in zip(kv.layers, before, strict=True):
        for block in (1, 3, 5):
            assert torch.equal(now[block], was[block])
        assert not torch.equal(now[7], was[7])


def test_extra_block_ids_are_ignored(device: str) -> None:
    kv = make_cache(KVLayoutKind.MLA, torch.bfloat16, 16, device, "fused")
    out_short = torch.zeros(kv.chunk_shape(32), dtype=kv.dtype, device=device)
    out_long = torch.zeros_like(out_short)
    gather_chunks(kv, [[4, 2]], [out_short])
    gather_chunks(kv, [[4, 2, 0, 1, 3]], [out_long])
    assert torch.equal(out_short, out_long)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_reference_follows_the_documented_formula(kind: KVLayoutKind, device: str) -> None:
    """Pin the oracle itself: chunk[kv, l, t] = flatten(block b[t // BS], token t % BS)."""
    kv = make_cache(kind, torch.float32, 4, device, "per_layer")
    ids = [7, 0, 3]
    out = torch.zeros(kv.chunk_shape(10), dtype=kv.dtype, device=device)
    ref_gather_chunks(kv, [ids], [out])
    for plane, layer_idx, t in itertools.product(range(kv.kv_size), range(2), range(10)):
        layer = kv.layers[layer_idx]
        b, off = ids[t // 4], t % 4
        if kind is KVLayoutKind.FLASH_ATTN:
            want = layer[plane, b, off].flatten()
        elif kind is KVLayoutKind.FLASHINFER:
            want = layer[b, plane, off].flatten()
        elif kind is KVLayoutKind.VLLM_CPU:
            want = _vllm_cpu_block(layer, plane, b)[off]
        else:
            want = layer[b, off]
        assert torch.equal(out[plane, layer_idx, t], want)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_multithreaded_cpu_path_matches_reference(
    kind: KVLayoutKind, storage: str, device: str
) -> None:
    """Chunks of >= 1 MiB are split over copy_threads() threads."""
    set_copy_threads(2)
    try:
        kv = make_cache(
            kind, torch.bfloat16, 16, device, storage, num_layers=4, kv_heads=8, head_dim=128,
            num_blocks=10,
        )  # fmt: skip
        ids, tokens = batch(kv, 4, 3)
        srcs = random_chunks(kv, tokens, device)
        before = snapshot(kv)
        ref_scatter_chunks(kv, ids, srcs, skip_first_n_tokens=17)
        expected = snapshot(kv)
        restore(kv, before)
        scatter_chunks(kv, ids, srcs, skip_first_n_tokens=17)
        assert all(torch.equal(a, b) for a, b in zip(kv.layers, expected, strict=True))
        outs = [torch.zeros_like(s) for s in srcs]
        want = [torch.zeros_like(s) for s in srcs]
        gather_chunks(kv, ids, outs)
        ref_gather_chunks(kv, ids, want)
        assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
    finally:
        set_copy_threads(None)


def test_copy_threads_follow_torch_unless_set() -> None:
    assert copy_threads() == max(1, torch.get_num_threads())
    set_copy_threads(3)
    try:
        assert copy_threads() == 3
    finally:
        set_copy_threads(None)
    with pytest.raises(ValueError, match="copy threads"):
        set_copy_threads(0)


def test_chunk_views_at_unaligned_offsets_copy_correctly(device: str) -> None:
    """An L1 object may start at any element of its pool; the row width adapts."""
    kv = make_cache(KVLayoutKind.FLASH_ATTN, torch.float16, 16, device, "fused")
    shape = kv.chunk_shape(20)
    numel = int(torch.tensor(shape).prod())
    pool = torch.zeros(numel + 1, dtype=kv.dtype, device=device)
    out = pool[1:].view(shape)  # 2-byte aligned only
    want = torch.zeros(shape, dtype=kv.dtype, device=device)
    gather_chunks(kv, [[3, 8]], [out])
    ref_gather_chunks(kv, [[3, 8]], [want])
    assert torch.equal(out, want)
    assert pool[0].item() == 0

    before = snapshot(kv)
    ref_scatter_chunks(kv, [[1, 2]], [out])
    expected = snapshot(kv)
    restore(kv, before)
    scatter_chunks(kv, [[1, 2]], [out])
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, expected, strict=True))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8])
def test_fp8_and_byte_caches_copy_bit_exactly(dtype: torch.dtype, device: str) -> None:
    shape = paged_layer_shape(KVLayoutKind.FLASH_ATTN, NUM_BLOCKS, 16, KV_HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(3)
    layers = [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype).to(device)
        for _ in range(NUM_LAYERS)
    ]
    kv = PagedKVCache(layers, KVLayoutKind.FLASH_ATTN)
    out = torch.zeros(kv.chunk_shape(24), dtype=dtype, device=device)
    want = torch.zeros_like(out)
    gather_chunks(kv, [[9, 1]], [out])
    ref_gather_chunks(kv, [[9, 1]], [want])
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_cpu_chunks_with_a_cuda_cache_are_staged_through_the_device(kind: KVLayoutKind) -> None:
    kv = make_cache(kind, torch.bfloat16, 16, "cuda", "fused")
    ids, tokens = batch(kv, 2, 5)
    outs = [torch.zeros(kv.chunk_shape(n), dtype=kv.dtype) for n in tokens]
    want = [torch.zeros_like(o) for o in outs]
    gather_chunks(kv, ids, outs)
    ref_gather_chunks(kv, ids, want)
    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))

    srcs = random_chunks(kv, tokens, "cpu")
    before = snapshot(kv)
    ref_scatter_chunks(kv, ids, srcs, skip_first_n_tokens=16)
    expected = snapshot(kv)
    restore(kv, before)
    scatter_chunks(kv, ids, srcs, skip_first_n_tokens=16)
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, expected, strict=True))


def _block(kind: KVLayoutKind, layer: torch.Tensor, plane: int, block: int) -> torch.Tensor:
    if kind is KVLayoutKind.FLASH_ATTN:
        return _flat(layer[plane, block])
    if kind is KVLayoutKind.FLASHINFER:
        return _flat(layer[block, plane])
    if kind is KVLayoutKind.VLLM_CPU:
        return _vllm_cpu_block(layer, plane, block)
    return layer[block]


def _vllm_cpu_block(layer: torch.Tensor, plane: int, block: int) -> torch.Tensor:
    """``[block_size, kv_heads * head_dim]`` of a VLLM_CPU block, written from the layout's text:
    per head, K as ``[head_dim][block_size]`` then V as ``[block_size][head_dim]``."""
    heads, block_size, width = layer.shape[1:]
    head_dim = width // 2
    per_head = []
    for head in range(heads):
        flat = layer[block, head].reshape(-1)
        if plane == 0:
            per_head.append(flat[: head_dim * block_size].reshape(head_dim, block_size).t())
        else:
            per_head.append(flat[head_dim * block_size :].reshape(block_size, head_dim))
    return torch.cat(per_head, dim=1)


def _flat(block: torch.Tensor) -> torch.Tensor:
    return block.reshape(block.shape[0], -1)


def test_parallel_pieces_each_run_once_and_a_failure_reaches_the_caller() -> None:
    import threading

    from kvmesh.kernels.parallel import run_parallel

    set_copy_threads(3)
    try:
        runs: list[int] = []
        lock = threading.Lock()

        def piece(i: int) -> None:
            with lock:
                runs.append(i)
            if i == 5:
                raise RuntimeError("piece 5 failed")

        pieces = [functools.partial(piece, i) for i in range(12)]
        with pytest.raises(RuntimeError, match="piece 5"):
            run_parallel(pieces, nbytes=1 << 30)
        assert sorted(runs) == list(range(12))  # the failure did not stop the other pieces
    finally:
        set_copy_threads(None)


def test_a_thread_limited_copy_runs_its_pieces_on_the_calling_thread_alone() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kvmesh.kernels.parallel import copies_limited_to, run_parallel

    def threads_used() -> set[int]:
        seen: set[int] = set()
        lock = threading.Lock()

        def piece() -> None:
            with lock:
                seen.add(threading.get_ident())
            threading.Event().wait(0.002)  # long enough for a helper to take some pieces

        run_parallel([piece] * 16, nbytes=1 << 30)
        return seen

    set_copy_threads(2)
    try:
        with copies_limited_to(1):
            assert copy_threads() == 1
            assert threads_used() == {threading.get_ident()}
            with copies_limited_to(None):  # nested: lifted inside, back after
                assert copy_threads() == 2
            assert copy_threads() == 1
            # Another thread's copies keep the process setting.
            with ThreadPoolExecutor(1) as other:
                assert other.submit(copy_threads).result() == 2
        assert copy_threads() == 2
        with copies_limited_to(5):  # a cap, never a raise
            assert copy_threads() == 2
    finally:
        set_copy_threads(None)
    with pytest.raises(ValueError, match="copy threads"), copies_limited_to(0):
        pass


def test_a_copy_cap_is_lifted_when_its_block_raises() -> None:
    from kvmesh.kernels.parallel import copies_limited_to

    set_copy_threads(2)
    try:
        with pytest.raises(RuntimeError, match="copy failed"), copies_limited_to(1):
            raise RuntimeError("copy failed")
        assert copy_threads() == 2  # the thread's next copy is not capped
    finally:
        set_copy_threads(None)
