"""The engine's paged KV cache is vLLM's flash-attn layout in one shared-memory file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvmesh.engine import (
    NULL_BLOCK_ID,
    BlockAllocator,
    ModelConfig,
    NoFreeBlocksError,
    SharedKVCache,
    TinyTransformer,
    blocks_needed,
)
from kvmesh.kernels import KVLayoutKind, PagedKVCache, gather_chunks, paged_layer_shape

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 10, 16, 2, 8


@pytest.fixture
def kv() -> Iterator[SharedKVCache]:
    with SharedKVCache(
        num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, kv_heads=HEADS, head_dim=DIM
    ) as cache:
        yield cache


def test_layers_have_the_vllm_flash_attn_shape(kv: SharedKVCache) -> None:
    expected = paged_layer_shape(KVLayoutKind.FLASH_ATTN, BLOCKS, BLOCK, HEADS, DIM)
    assert [tuple(t.shape) for t in kv.layers] == [expected] * LAYERS
    assert all(t.is_contiguous() and t.dtype == torch.float32 for t in kv.layers)
    # kvmesh's own validation of engine memory accepts it as FLASH_ATTN.
    PagedKVCache(kv.layers, KVLayoutKind.FLASH_ATTN)


def test_every_layer_lives_in_one_shm_file_at_layer_index_times_layer_bytes(
    kv: SharedKVCache,
) -> None:
    layer_bytes = 2 * BLOCKS * BLOCK * HEADS * DIM * 4
    assert Path(kv.path).parent == Path("/dev/shm")
    assert os.path.getsize(kv.path) == LAYERS * layer_bytes
    assert [(r.path, r.offset_bytes, r.size_bytes) for r in kv.regions()] == [
        (kv.path, i * layer_bytes, layer_bytes) for i in range(LAYERS)
    ]
    # A write through layer 2's tensor lands at its region of the file (shared mapping).
    kv.layers[2][1, 4, 3, 1, 5] = 42.0
    element = ((((1 * BLOCKS + 4) * BLOCK + 3) * HEADS + 1) * DIM + 5) * 4
    fd = os.open(kv.path, os.O_RDONLY)
    try:
        raw = os.pread(fd, 4, kv.region(2).offset_bytes + element)
    finally:
        os.close(fd)
    assert torch.frombuffer(bytearray(raw), dtype=torch.float32).item() == 42.0


def test_close_unlinks_the_file() -> None:
    cache = SharedKVCache(num_layers=1, num_blocks=2, block_size=4, kv_heads=1, head_dim=2)
    path = cache.path
    assert os.path.exists(path)
    cache.close()
    cache.close()
    assert not os.path.exists(path)


def test_token_kv_sits_at_its_block_and_row_and_kvmesh_gathers_it_per_chunk() -> None:
    config = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=256)
    model = TinyTransformer(config)
    chunk = 64
    tokens = torch.randint(0, 256, (chunk,), generator=torch.Generator().manual_seed(0)).tolist()
    with SharedKVCache(
        num_layers=2, num_blocks=12, block_size=BLOCK, kv_heads=2, head_dim=32
    ) as cache:
        block_ids = [7, 2, 9, 4]  # deliberately out of order
        model.prefill(tokens, cache.layers, block_ids, tile_size=chunk)
        # Layer 0's K/V of a token depend only on that token and its position.
        layer = model.layers[0]
        x = model.embed[torch.tensor(tokens)]
        qkv = model._rms_norm(x, layer.attn_norm) @ layer.w_qkv.T
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        k = qkv[:, q_dim : q_dim + kv_dim].view(chunk, 2, 32)
        k = model._rope(k, torch.arange(chunk))
        v = qkv[:, q_dim + kv_dim :].view(chunk, 2, 32)
        for p in range(chunk):
            blk, row = block_ids[p // BLOCK], p % BLOCK
            assert torch.equal(cache.layers[0][0, blk, row], k[p])
            assert torch.equal(cache.layers[0][1, blk, row], v[p])
        # kvmesh's gather (what storage runs on Store) yields token-major [2, L, T, H*D].
        out = torch.empty(2, 2, chunk, 64)
        gather_chunks(PagedKVCache(cache.layers, KVLayoutKind.FLASH_ATTN), [block_ids], [out])
        assert torch.equal(out[0, 0], k.reshape(chunk, 64))
        assert torch.equal(out[1, 0], v.reshape(chunk, 64))


def test_allocator_never_hands_out_the_null_block() -> None:
    alloc = BlockAllocator(5)
    assert sorted(alloc.allocate(4)) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID == 0
    assert alloc.num_free_blocks == 0


def test_allocator_reuses_freed_blocks_oldest_first() -> None:
    alloc = BlockAllocator(6)
    first = alloc.allocate(3)
    alloc.allocate(2)
    alloc.free(first)
    assert alloc.allocate(3) == first


def test_allocation_beyond_free_blocks_fails_and_takes_nothing() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate(2)
    assert alloc.num_free_blocks == 1


def test_freeing_a_block_twice_is_an_error() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(blocks[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([0])


def test_blocks_needed_rounds_up() -> None:
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 256)] == [0, 1, 1, 2, 16]
