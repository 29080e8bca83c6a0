"""Token hashing is byte-identical to LMCache 0.5.6 (vectors from the reference, §4)."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.common.hashing import NONE_HASH, TokenHasher

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
