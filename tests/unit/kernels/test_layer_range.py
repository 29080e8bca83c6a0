"""A scatter of some layers (one part of a load by layers) writes exactly those layers.

Every layout kind, both dtypes engines use on CPUs, layers in one storage and
apart, the native kernel and the torch fallback: the parts of a load, run in
order, leave the cache exactly as one whole scatter does, and each part
writes its own layers only.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels import KVLayoutKind, PagedKVCache, paged_layer_shape, scatter_chunks
from kvmesh.kernels._plan import planes_contiguous
from kvmesh.kernels.layer_range import select_layers

NUM_LAYERS = 5
NUM_BLOCKS = 8
KV_HEADS = 2
BLOCK_SIZE = 16
HEAD_DIM = 16  # VLLM_CPU_AMX tiles 16 dims
#: The parts the connector sends for 5 layers (connector/layered.py's groups).
PARTS = [(0, 1), (1, 3), (3, 5)]


@pytest.fixture(params=["native", "no_native", "torch_ops"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The native kernel; without it (NumPy, or vLLM's layouts' torch fallback); and the
    torch ops CUDA caches use, run on the CPU."""
    import kvmesh.kernels.ops

    if request.param != "native":
        monkeypatch.setenv("KVMESH_NATIVE_COPY", "0")
    if request.param == "torch_ops":
        monkeypatch.setattr(kvmesh.kernels.ops, "_CPU_BACKEND", "torch")
    return str(request.param)


def make_cache(kind: KVLayoutKind, dtype: torch.dtype, fused: bool) -> PagedKVCache:
    shape = paged_layer_shape(kind, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    if fused:
        flat = torch.randn(NUM_LAYERS * int(torch.tensor(shape).prod()), generator=gen).to(dtype)
        layers = list(flat.view(NUM_LAYERS, *shape).unbind(0))
    else:
        layers = [torch.randn(shape, generator=gen).to(dtype) for _ in range(NUM_LAYERS)]
    return PagedKVCache(layers, kind)


def chunks_for(kv: PagedKVCache) -> tuple[list[list[int]], list[torch.Tensor]]:
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    gen = torch.Generator().manual_seed(2)
    chunks = [torch.randn(kv.chunk_shape(2 * BLOCK_SIZE), generator=gen).to(kv.dtype)]
    chunks.append(torch.randn(kv.chunk_shape(2 * BLOCK_SIZE), generator=gen).to(kv.dtype))
    return [ids[:2], ids[2:4]], chunks


@pytest.mark.parametrize(
    ("kind", "dtype", "fused"),
    list(itertools.product(KVLayoutKind, [torch.bfloat16, torch.float32], [True, False])),
)
def test_parts_in_order_equal_one_whole_scatter(
    kind: KVLayoutKind, dtype: torch.dtype, fused: bool, backend: str
) -> None:
    whole, parted = make_cache(kind, dtype, fused), make_cache(kind, dtype, fused)
    ids, chunks = chunks_for(whole)
    scatter_chunks(whole, ids, chunks, skip_first_n_tokens=BLOCK_SIZE + 3)
    before = [layer.clone() for layer in parted.layers]
    for start, end in PARTS:
        sub, views = select_layers(parted, chunks, start, end)
        scatter_chunks(sub, ids, views, skip_first_n_tokens=BLOCK_SIZE + 3)
        # This part wrote its own layers only: the later ones are still as they were.
        for layer in range(end, NUM_LAYERS):
            assert torch.equal(parted.layers[layer], before[layer]), (start, end, layer)
    for a, b in zip(whole.layers, parted.layers, strict=True):
        assert torch.equal(a, b)


def test_vllm_cpu_parts_are_views_and_other_kinds_copies() -> None:
    cpu = make_cache(KVLayoutKind.VLLM_CPU, torch.float32, True)
    _, chunks = chunks_for(cpu)
    sub, views = select_layers(cpu, chunks, 1, 3)
    assert sub.num_layers == 2
    assert sub.layers[0] is cpu.layers[1]
    assert views[0].data_ptr() == chunks[0][0, 1].data_ptr()
    assert not views[0].is_contiguous()
    assert planes_contiguous(views[0])
    flash = make_cache(KVLayoutKind.FLASH_ATTN, torch.float32, True)
    _, chunks = chunks_for(flash)
    _, copies = select_layers(flash, chunks, 1, 3)
    assert copies[0].is_contiguous()
    assert torch.equal(copies[0], chunks[0][:, 1:3])
    # The whole range is the cache itself, not a copy of it.
    assert select_layers(flash, chunks, 0, NUM_LAYERS)[0] is flash


@pytest.mark.parametrize(("start", "end"), [(0, 0), (2, 1), (3, 3), (0, 6), (5, 6), (-1, 2)])
def test_a_range_that_is_not_a_non_empty_part_of_the_layers_is_refused(
    start: int, end: int
) -> None:
    kv = make_cache(KVLayoutKind.FLASH_ATTN, torch.float32, False)
    _, chunks = chunks_for(kv)
    with pytest.raises(InvalidArgument, match=r"layer range .* of the engine's 5 layers"):
        select_layers(kv, chunks, start, end)


def test_a_strided_chunk_is_refused_unless_each_layer_plane_is_contiguous() -> None:
    kv = make_cache(KVLayoutKind.VLLM_CPU, torch.float32, True)
    ids, chunks = chunks_for(kv)
    transposed = chunks[0].transpose(2, 3).contiguous().transpose(2, 3)  # tokens strided
    assert not planes_contiguous(transposed)
    with pytest.raises(InvalidArgument, match="must be contiguous"):
        scatter_chunks(kv, ids[:1], [transposed])
