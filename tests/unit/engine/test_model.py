"""The tiny transformer: a cached prefix gives bit-identical logits, with no services.

The "cache" here is blocks copied by hand from one request's block table to
another's — exactly what a kvmesh retrieve does — and the blocks the cache
does not supply are poisoned with NaN, so a model that read them before
writing them would produce NaN logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kvmesh.engine import BlockAllocator, ModelConfig, SharedKVCache, TinyTransformer, blocks_needed

BLOCK = 16
TILE = 256
MODEL = ModelConfig()

# (prompt length, tokens supplied by the cache): chunk-aligned hits, a hit that ends
# inside a tile (block-aligned, e.g. a local prefix cache), and the full-hit case where
# the last token is recomputed (hit = len - 1 rounded down to a block).
CACHED_PREFIX_CASES = [
    (700, 256),
    (700, 512),
    (1024, 1008),
    (1000, 304),
    (530, 16),
]


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(MODEL)


@pytest.fixture
def kv() -> Iterator[SharedKVCache]:
    with SharedKVCache(
        num_layers=MODEL.num_layers,
        num_blocks=256,
        block_size=BLOCK,
        kv_heads=MODEL.num_kv_heads,
        head_dim=MODEL.head_dim,
    ) as cache:
        yield cache


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=gen).tolist()


def _poison(kv: SharedKVCache, blocks: list[int]) -> None:
    ids = torch.tensor(blocks)
    for layer in kv.layers:
        layer[:, ids] = float("nan")


@pytest.mark.parametrize(("n", "cached"), CACHED_PREFIX_CASES)
def test_prefill_with_cached_prefix_gives_bit_identical_logits(
    model: TinyTransformer, kv: SharedKVCache, n: int, cached: int
) -> None:
    alloc = BlockAllocator(kv.num_blocks)
    tokens = _tokens(n, seed=n)
    cold_blocks = alloc.allocate(blocks_needed(n, BLOCK))
    cold = model.prefill(tokens, kv.layers, cold_blocks, tile_size=TILE)

    warm_blocks = alloc.allocate(blocks_needed(n, BLOCK))
    _poison(kv, warm_blocks)
    prefix_blocks = cached // BLOCK
    kv.copy_blocks(cold_blocks[:prefix_blocks], warm_blocks[:prefix_blocks])
    warm = model.prefill(tokens, kv.layers, warm_blocks, num_computed_tokens=cached, tile_size=TILE)

    assert not torch.isnan(warm).any()
    assert torch.equal(warm, cold)
    # The KV the warm run computed is the cold run's, bit for bit, for every prompt token.
    for layer in kv.layers:
        flat = layer.view(2, -1, MODEL.num_kv_heads, MODEL.head_dim)
        slots = lambda blocks: torch.tensor(  # noqa: E731
            [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        )
        assert torch.equal(flat[:, slots(warm_blocks)], flat[:, slots(cold_blocks)])


def test_prefix_cached_by_another_prompt_gives_the_logits_of_a_full_prefill(
    model: TinyTransformer, kv: SharedKVCache
) -> None:
    alloc = BlockAllocator(kv.num_blocks)
    shared = _tokens(600, seed=1)
    first = shared + _tokens(200, seed=2)
    second = shared + _tokens(300, seed=3)
    first_blocks = alloc.allocate(blocks_needed(len(first), BLOCK))
    model.prefill(first, kv.layers, first_blocks, tile_size=TILE)
    reference_blocks = alloc.allocate(blocks_needed(len(second), BLOCK))
    reference = model.prefill(second, kv.layers, reference_blocks, tile_size=TILE)

    blocks = alloc.allocate(blocks_needed(len(second), BLOCK))
    _poison(kv, blocks)
    # Only whole chunks of the shared prefix are cached: 512 of its 600 tokens.
    kv.copy_blocks(first_blocks[: 512 // BLOCK], blocks[: 512 // BLOCK])
    warm = model.prefill(second, kv.layers, blocks, num_computed_tokens=512, tile_size=TILE)

    assert torch.equal(warm, reference)


def test_logits_are_computed_from_the_cached_kv_not_recomputed(
    model: TinyTransformer, kv: SharedKVCache
) -> None:
    alloc = BlockAllocator(kv.num_blocks)
    tokens = _tokens(600, seed=4)
    blocks = alloc.allocate(blocks_needed(600, BLOCK))
    cold = model.prefill(tokens, kv.layers, blocks, tile_size=TILE)
    kv.layers[0][1, blocks[3]] += 0.5  # perturb V of tokens 48..63 of layer 0
    warm = model.prefill(tokens, kv.layers, blocks, num_computed_tokens=512, tile_size=TILE)

    assert not torch.equal(warm, cold)


def test_rows_the_cache_supplied_are_not_rewritten(
    model: TinyTransformer, kv: SharedKVCache
) -> None:
    alloc = BlockAllocator(kv.num_blocks)
    tokens = _tokens(700, seed=5)
    blocks = alloc.allocate(blocks_needed(700, BLOCK))
    model.prefill(tokens, kv.layers, blocks, tile_size=TILE)
    # Mark the supplied rows of the partly cached tile [512, 768): tokens 512..543.
    marked = blocks[32:34]
    for layer in kv.layers:
        layer[:, marked] = 7.0
    model.prefill(tokens, kv.layers, blocks, num_computed_tokens=544, tile_size=TILE)

    for layer in kv.layers:
        assert bool((layer[:, marked] == 7.0).all())


def test_greedy_decode_after_a_cached_prefill_matches_a_cold_one(
    model: TinyTransformer, kv: SharedKVCache
) -> None:
    alloc = BlockAllocator(kv.num_blocks)
    tokens = _tokens(512, seed=6)

    def run(blocks: list[int], cached: int) -> list[int]:
        logits = model.prefill(tokens, kv.layers, blocks, num_computed_tokens=cached)
        out = []
        for step in range(4):
            token = int(torch.argmax(logits))
            out.append(token)
            logits = model.decode(token, len(tokens) + step, kv.layers, blocks)
        return out

    cold_blocks = alloc.allocate(blocks_needed(512 + 4, BLOCK))
    cold = run(cold_blocks, 0)
    warm_blocks = alloc.allocate(blocks_needed(512 + 4, BLOCK))
    _poison(kv, warm_blocks)
    kv.copy_blocks(cold_blocks[:31], warm_blocks[:31])

    assert run(warm_blocks, 496) == cold


def test_prefill_must_compute_at_least_the_last_token(
    model: TinyTransformer, kv: SharedKVCache
) -> None:
    blocks = BlockAllocator(kv.num_blocks).allocate(2)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        model.prefill(_tokens(32, seed=7), kv.layers, blocks, num_computed_tokens=32)


def test_prefill_rejects_a_block_table_too_short_for_the_prompt(
    model: TinyTransformer, kv: SharedKVCache
) -> None:
    blocks = BlockAllocator(kv.num_blocks).allocate(1)
    with pytest.raises(ValueError, match="cannot hold"):
        model.prefill(_tokens(17, seed=8), kv.layers, blocks)


def test_weights_are_fixed_by_the_seed() -> None:
    small = ModelConfig(num_layers=1, hidden_size=64, intermediate_size=128, vocab_size=512)
    tokens = [t % small.vocab_size for t in _tokens(40, seed=9)]

    def logits(config: ModelConfig) -> torch.Tensor:
        with SharedKVCache(
            num_layers=config.num_layers,
            num_blocks=8,
            block_size=BLOCK,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        ) as cache:
            return TinyTransformer(config).prefill(tokens, cache.layers, [1, 2, 3])

    first = logits(small)
    assert torch.equal(first, logits(small))
    assert not torch.equal(first, logits(replace(small, seed=1)))
