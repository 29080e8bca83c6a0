"""Token hashing is byte-identical to LMCache 0.5.6 (vectors computed with LMCache 0.5.6)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.hashing import NONE_HASH, TokenHasher

NONE_HASH_HEX = "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
CHUNK0_HEX = "084547b6c40ed5b05ba8cd0305db5bf74d5617673948d9ed193ab7d6cbc484d4"
CHUNK1_HEX = "e5ffee45c2b9db326814c9692dc594369887ba3b0df5761817820b60f864c8e0"


def test_none_hash_matches_lmcache() -> None:
    assert NONE_HASH.hex() == NONE_HASH_HEX


def test_chained_chunk_hashes_match_lmcache_vectors() -> None:
    hashes = TokenHasher(256).hash_chunks(list(range(512)))
    assert [h.hex() for h in hashes] == [CHUNK0_HEX, CHUNK1_HEX]


@pytest.mark.parametrize("container", [list, np.asarray, lambda t: np.asarray(t, dtype=np.uint32)])
def test_any_integer_container_hashes_the_same(container) -> None:  # type: ignore[no-untyped-def]
    assert TokenHasher(256).hash_chunks(container(list(range(512))))[1].hex() == CHUNK1_HEX


def test_trailing_partial_chunk_is_ignored() -> None:
    hasher = TokenHasher(256)
    assert hasher.hash_chunks(list(range(511))) == hasher.hash_chunks(list(range(256)))
    assert hasher.hash_chunks(list(range(255))) == []


def test_incremental_extension_equals_hashing_the_whole_prefix() -> None:
    hasher = TokenHasher(16)
    tokens = np.arange(100, dtype=np.uint32)
    first = hasher.hash_chunks(tokens[:48])
    rest = hasher.hash_chunks(tokens[48:96], prefix_hash=first[-1])
    assert first + rest == hasher.hash_chunks(tokens)


def test_a_different_earlier_chunk_changes_every_later_hash() -> None:
    hasher = TokenHasher(4)
    a = hasher.hash_chunks([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.hash_chunks([1, 2, 3, 9, 5, 6, 7, 8])
    assert a[0] != b[0]
    assert a[1] != b[1]


@pytest.mark.parametrize("bad", [[-1] * 4, [2**32] * 4])
def test_tokens_outside_uint32_are_invalid_argument(bad: list[int]) -> None:
    with pytest.raises(InvalidArgument):
        TokenHasher(4).hash_chunks(bad)


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(InvalidArgument):
        TokenHasher(0)


# -- the memo of recent prefix hashes ----------------------------------------------------


def test_memoized_hashes_equal_fresh_ones_for_every_prompt() -> None:
    rng = np.random.default_rng(7)
    plain = TokenHasher(16)
    memo = TokenHasher(16, memo_entries=64)
    shared = rng.integers(0, 50_000, 48, dtype=np.uint32)
    for _ in range(20):
        tail = rng.integers(0, 50_000, int(rng.integers(0, 64)), dtype=np.uint32)
        prompt = np.concatenate([shared, tail])
        assert memo.hash_chunks(prompt) == plain.hash_chunks(prompt)
        # Continuing a chain from a hash is memoized under that hash, not the default.
        head = plain.hash_chunks(prompt[:16])
        assert memo.hash_chunks(prompt[16:], prefix_hash=head[0]) == plain.hash_chunks(prompt)[1:]
    assert plain.memo_hits == plain.memo_misses == 0


def test_the_memo_hits_on_a_repeated_prefix_and_matches_the_lmcache_vectors() -> None:
    tokens = list(range(8 * 256))
    hasher = TokenHasher(256, memo_entries=16)
    first = hasher.hash_chunks(tokens)
    assert (hasher.memo_hits, hasher.memo_misses) == (0, 8)
    assert hasher.hash_chunks(tokens) == first == TokenHasher(256).hash_chunks(tokens)
    assert (hasher.memo_hits, hasher.memo_misses) == (8, 8)


def test_the_memo_never_holds_more_than_its_entries() -> None:
    hasher = TokenHasher(4, memo_entries=5)
    tokens = np.arange(4 * 12, dtype=np.uint32)
    hasher.hash_chunks(tokens)
    assert len(hasher._memo) == 5
    # The oldest links were dropped: hashing again misses at the start, hits none of them.
    hits = hasher.memo_hits
    hasher.hash_chunks(tokens[:8])
    assert hasher.memo_hits == hits
    assert len(hasher._memo) == 5


def test_a_memo_size_below_zero_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        TokenHasher(16, memo_entries=-1)


def test_uint32_tokens_skip_the_range_check_but_hash_the_same() -> None:
    values = [0, 1, 2**32 - 1, 12345] * 8
    as_u32 = np.array(values, dtype=np.uint32)
    as_i64 = np.array(values, dtype=np.int64)
    assert TokenHasher(8).hash_chunks(as_u32) == TokenHasher(8).hash_chunks(as_i64)
