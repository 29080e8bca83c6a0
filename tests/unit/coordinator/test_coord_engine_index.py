"""EngineIndex: vLLM block events → the kvmesh chunks an engine holds."""

from __future__ import annotations

import random

import pytest

from kvmesh.common.hashing import TokenHasher
from kvmesh.common.keys import salt_with_lora
from kvmesh.coordinator.core.engineevents import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.coordinator.core.engineindex import EngineIndex

CHUNK = 64


def _blocks(tokens: list[int], bs: int, tag: str = "") -> list[int]:
    """Stand-in engine block hashes: any value unique per (prefix, tag) works."""
    return [hash((tag, tuple(tokens[: (i + 1) * bs]))) for i in range(len(tokens) // bs)]


def _stored(
    tokens: list[int],
    bs: int,
    *,
    first: int = 0,
    count: int | None = None,
    salt: str = "",
    lora: str | None = None,
    tag: str = "",
) -> BlockStored:
    hashes = _blocks(tokens, bs, tag)
    count = len(hashes) - first if count is None else count
    extra: list[tuple[object, ...] | None] = [None] * count
    if first == 0 and salt:
        extra[0] = ((lora,) if lora else ()) + (salt,)
    return BlockStored(
        block_hashes=tuple(hashes[first : first + count]),
        parent=hashes[first - 1] if first else None,
        token_ids=tuple(tokens[first * bs : (first + count) * bs]),
        block_size=bs,
        lora_name=lora,
        lora_id=3 if lora else None,
        extra_keys=tuple(extra),
    )


def _held(
    index: EngineIndex, tokens: list[int], salt: str = "", ranks: tuple[int, ...] = (0,)
) -> list[bool]:
    """Per chunk of ``tokens``: whether the engine holds it (each chunk asked alone)."""
    hashes = TokenHasher(CHUNK).hash_chunks(tokens)
    return [index.leading_held("e", ranks, salt, [h]) == 1 for h in hashes]


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


@pytest.mark.parametrize("bs", [16, 64, 128, 24])
def test_chunks_of_a_stored_prompt_match_kvmesh_hashes(bs: int) -> None:
    index = EngineIndex(CHUNK)
    tokens = _tokens(bs * 20)
    # Stored in three events, as vLLM does across scheduler steps.
    n = len(tokens) // bs
    index.apply("e", 0, [_stored(tokens, bs, first=0, count=3)])
    index.apply("e", 0, [_stored(tokens, bs, first=3, count=8)])
    index.apply("e", 0, [_stored(tokens, bs, first=11, count=n - 11)])
    held = _held(index, tokens)
    assert held == [True] * (len(tokens) // CHUNK)
    assert index.counts("e", 0).chunks == len(tokens) // CHUNK
    # Another prompt sharing nothing is not held; one sharing the first chunk only, partly.
    assert not any(_held(index, _tokens(bs * 20, seed=1)))
    other = tokens[:CHUNK] + _tokens(CHUNK * 2, seed=2)
    assert _held(index, other) == [True, False, False]


def test_removing_a_middle_block_unholds_its_chunk_and_a_restore_brings_it_back() -> None:
    index = EngineIndex(CHUNK)
    tokens = _tokens(16 * 16)
    hashes = _blocks(tokens, 16)
    index.apply("e", 0, [_stored(tokens, 16)])
    assert _held(index, tokens) == [True, True, True, True]
    # Block 5 is inside chunk 1 (tokens 64..127).
    index.apply("e", 0, [BlockRemoved((hashes[5],))])
    assert _held(index, tokens) == [True, False, True, True]
    index.apply("e", 0, [_stored(tokens, 16, first=5, count=1)])
    assert _held(index, tokens) == [True, True, True, True]
    # Evicting the tail, as vLLM does, leaves the head.
    index.apply("e", 0, [BlockRemoved(tuple(reversed(hashes[8:])))])
    assert _held(index, tokens) == [True, True, False, False]
    assert index.counts("e", 0).blocks == 8
    # Only a leading run counts for a prompt.
    index.apply("e", 0, [BlockRemoved((hashes[2],))])
    assert index.leading_held("e", [0], "", TokenHasher(CHUNK).hash_chunks(tokens)) == 0


def test_media_are_tracked_apart() -> None:
    index = EngineIndex(CHUNK)
    tokens = _tokens(CHUNK)
    hashes = tuple(_blocks(tokens, 16))
    stored = _stored(tokens, 16)
    index.apply("e", 0, [stored])
    index.apply(
        "e",
        0,
        [
            BlockStored(
                stored.block_hashes, None, stored.token_ids, 16, medium="CPU", extra_keys=None
            )
        ],
    )
    index.apply("e", 0, [BlockRemoved(hashes, medium="GPU")])
    assert _held(index, tokens) == [True]
    index.apply("e", 0, [BlockRemoved(hashes, medium="CPU")])
    assert _held(index, tokens) == [False]


def test_salt_and_lora_are_part_of_the_key() -> None:
    index = EngineIndex(CHUNK)
    tokens = _tokens(CHUNK * 2)
    index.apply("e", 0, [_stored(tokens, 16, salt="tenant-a", lora="ad", tag="a")])
    assert _held(index, tokens) == [False, False]
    assert _held(index, tokens, "tenant-a") == [False, False]
    assert _held(index, tokens, salt_with_lora("tenant-a", "ad", 3)) == [True, True]


def test_multimodal_blocks_never_match() -> None:
    index = EngineIndex(CHUNK)
    tokens = _tokens(CHUNK * 2)
    stored = _stored(tokens, 16)
    extra = [None] * len(stored.block_hashes)
    extra[5] = (("image-1", 0),)
    index.apply(
        "e",
        0,
        [BlockStored(stored.block_hashes, None, stored.token_ids, 16, extra_keys=tuple(extra))],
    )
    # Chunk 0 (blocks 0-3) is plain; from block 5 on the tokens do not name the KV.
    assert _held(index, tokens) == [True, False]


def test_unknown_parent_other_groups_and_short_tokens_are_skipped() -> None:
    index = EngineIndex(CHUNK)
    tokens = _tokens(CHUNK * 2)
    index.apply("e", 0, [_stored(tokens, 16, first=4)])
    bad = _stored(tokens, 16)
    index.apply(
        "e",
        0,
        [
            BlockStored(bad.block_hashes, None, bad.token_ids[:-1], 16),
            BlockStored(bad.block_hashes, None, bad.token_ids, 16, group_idx=1),
        ],
    )
    assert index.skipped_events == 3
    assert index.counts("e", 0).blocks == 0


def test_clear_and_reset_forget_everything() -> None:
    index = EngineIndex(CHUNK)
    tokens = _tokens(CHUNK * 2)
    index.apply("e", 0, [_stored(tokens, 16)])
    index.apply("e", 0, [AllBlocksCleared()])
    assert _held(index, tokens) == [False, False]
    index.apply("e", 0, [_stored(tokens, 16)])
    index.reset_stream("e", 0)
    assert index.counts("e", 0).blocks == 0
    index.apply("e", 1, [_stored(tokens, 16)])
    assert _held(index, tokens, ranks=(0, 1)) == [True, True]
    index.drop_engine("e")
    assert index.counts("e", 1).blocks == 0


def test_branches_share_their_common_chunks() -> None:
    index = EngineIndex(CHUNK)
    base = _tokens(CHUNK + 32)
    a = base + _tokens(CHUNK - 32 + CHUNK, seed=5)
    b = base + _tokens(CHUNK - 32 + CHUNK, seed=6)
    index.apply("e", 0, [_stored(a, 16)])
    index.apply("e", 0, [_stored(b, 16, first=(CHUNK + 32) // 16)])
    assert _held(index, a) == [True, True, True]
    assert _held(index, b) == [True, True, True]
    # Dropping a's tail leaves b whole.
    hashes_a = _blocks(a, 16)
    index.apply("e", 0, [BlockRemoved(tuple(hashes_a[6:]))])
    assert _held(index, a) == [True, False, False]
    assert _held(index, b) == [True, True, True]
