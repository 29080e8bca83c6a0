"""The node's fingerprint index of segments (storage.core.segment_catalog), without a server."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.segment_catalog import SegmentCatalog, checked_segment_tokens

MODEL = "m"
LIKE = ObjectKey(b"", MODEL, 0)


def _doc(first: int, n: int) -> np.ndarray:
    return np.arange(first, first + n, dtype=np.uint32)


def _noted(catalog: SegmentCatalog, tokens: np.ndarray, salt: str = "") -> ObjectKey:
    key = ObjectKey(segment_key(MODEL, tokens), MODEL, 0, 0, salt)
    catalog.note(key, checked_segment_tokens(key, tokens, "t"))
    return key


def test_two_documents_with_one_start_are_told_apart_by_their_whole_key() -> None:
    catalog = SegmentCatalog()
    long = _doc(100, 40)
    short = long[:20].copy()
    _noted(catalog, long)
    _noted(catalog, short)
    prompt = np.concatenate([_doc(1, 3), short, _doc(7, 4)])  # the short one only
    matches, _ = catalog.find(LIKE, prompt, 1, lambda key: True)
    assert [(s, n) for s, n, _ in matches] == [(3, 20)]
    both = np.concatenate([long, _doc(1, 2)])
    matches, _ = catalog.find(LIKE, both, 1, lambda key: True)
    assert [(s, n) for s, n, _ in matches] == [(0, 40)]  # the longest wins
    assert len(catalog) == 2  # neither hint was dropped


def test_segments_with_the_same_start_and_length_are_each_found() -> None:
    """A system prompt followed by one document or another: one head, one length."""
    catalog = SegmentCatalog()
    system = _doc(1, 20)
    a = np.concatenate([system, _doc(100, 30)])
    b = np.concatenate([system, _doc(200, 30)])
    key_a, key_b = _noted(catalog, a), _noted(catalog, b)
    assert len(catalog) == 2
    assert catalog.find(LIKE, a, 1, lambda key: True)[0] == [(0, 50, key_a)]
    assert catalog.find(LIKE, b, 1, lambda key: True)[0] == [(0, 50, key_b)]
    assert catalog.find(LIKE, a, 1, lambda key: key != key_a)[0] == []  # a left L1
    assert len(catalog) == 1
    assert catalog.head_of(key_a) is None
    assert catalog.find(LIKE, b, 1, lambda key: True)[0] == [(0, 50, key_b)]


def test_salt_rank_and_model_keep_entries_apart_and_absent_ones_are_dropped() -> None:
    catalog = SegmentCatalog()
    doc = _doc(5, 16)
    _noted(catalog, doc, salt="a")
    assert catalog.find(LIKE, doc, 1, lambda key: True)[0] == []
    assert catalog.find(ObjectKey(b"", MODEL, 1, 0, "a"), doc, 1, lambda key: True)[0] == []
    assert catalog.find(ObjectKey(b"", MODEL, 0, 0, "a"), doc, 1, lambda key: False)[0] == []
    assert len(catalog) == 0


def test_short_segments_are_not_indexed_and_the_index_is_bounded() -> None:
    catalog = SegmentCatalog(max_entries=2)
    _noted(catalog, _doc(1, 15))
    assert len(catalog) == 0
    for i in (1, 2, 3):
        _noted(catalog, _doc(1000 * i, 16))
    assert len(catalog) == 2
    prompt = _doc(1000, 16)
    assert catalog.find(LIKE, prompt, 1, lambda key: True)[0] == []  # the oldest went first


def test_tokens_that_do_not_make_the_key_are_refused() -> None:
    key = ObjectKey(segment_key(MODEL, _doc(1, 20)), MODEL, 0)
    with pytest.raises(InvalidArgument, match="not the tokens"):
        checked_segment_tokens(key, _doc(2, 20), "segment_token_ids")
    with pytest.raises(InvalidArgument):
        checked_segment_tokens(key, [], "segment_token_ids")
