"""Bad inputs to the kernels raise InvalidArgument naming the field, before any copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels import (
    KVLayoutKind,
    PagedKVCache,
    gather_chunks,
    paged_layer_shape,
    ref_gather_chunks,
    ref_scatter_chunks,
    scatter_chunks,
)

GATHERS = [gather_chunks, ref_gather_chunks]
SCATTERS = [scatter_chunks, ref_scatter_chunks]

NUM_BLOCKS = 8
BS = 4


def make_cache(kind: KVLayoutKind = KVLayoutKind.FLASH_ATTN) -> PagedKVCache:
    shape = paged_layer_shape(kind, NUM_BLOCKS, BS, 2, 4)
    gen = torch.Generator().manual_seed(0)
    return PagedKVCache([torch.randn(shape, generator=gen) for _ in range(2)], kind)


def chunk(kv: PagedKVCache, tokens: int, fill: float = 5.0) -> torch.Tensor:
    return torch.full(kv.chunk_shape(tokens), fill, dtype=kv.dtype)


def assert_cache_unchanged(kv: PagedKVCache, before: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, before, strict=True))


def two_chunks(kv: PagedKVCache) -> list[Any]:
    return [chunk(kv, 4), chunk(kv, 4)]


def with_second(bad: Callable[[], Any]) -> Callable[[PagedKVCache], list[Any]]:
    """A batch whose first chunk is valid and whose second is ``bad()``."""
    return lambda kv: [chunk(kv, 4), bad()]


INT_2D = torch.zeros(1, 1, dtype=torch.int64)

# Each case: (description, block_ids, chunk factory, expected field). The first
# chunk is always valid: a late failure must not leave it copied.
BAD_BATCHES: list[tuple[str, Any, Callable[[PagedKVCache], list[Any]], str]] = [
    ("too_few_block_ids", [[0], [1]], lambda kv: [chunk(kv, 4), chunk(kv, 8)], "block_ids[1]"),
    ("block_id_equal_num_blocks", [[0], [NUM_BLOCKS]], two_chunks, "block_ids[1]"),
    ("negative_block_id", [[0], [-1]], two_chunks, "block_ids[1]"),
    ("float_block_ids", [[0], torch.tensor([1.0])], two_chunks, "block_ids[1]"),
    ("bool_block_id", [[0], [True]], two_chunks, "block_ids[1]"),
    ("2d_block_id_tensor", [[0], INT_2D], two_chunks, "block_ids[1]"),
    ("string_block_ids", [[0], "12"], two_chunks, "block_ids[1]"),
    ("fewer_id_lists_than_chunks", [[0]], two_chunks, "block_ids"),
    ("wrong_dtype", [[0], [1]], with_second(lambda: torch.zeros(2, 2, 4, 8).half()), "[1]"),
    ("wrong_layer_count", [[0], [1]], with_second(lambda: torch.zeros(2, 3, 4, 8)), "[1]"),
    ("wrong_hidden", [[0], [1]], with_second(lambda: torch.zeros(2, 2, 4, 7)), "[1]"),
    ("zero_tokens", [[0], [1]], with_second(lambda: torch.zeros(2, 2, 0, 8)), "[1]"),
    ("rank_3_chunk", [[0], [1]], with_second(lambda: torch.zeros(2, 2, 32)), "[1]"),
    (
        "not_contiguous",
        [[0], [1]],
        with_second(lambda: torch.zeros(2, 2, 8, 4).transpose(2, 3)),
        "[1]",
    ),
    ("not_a_tensor", [[0], [1]], with_second(lambda: [[0.0]]), "[1]"),
]


@pytest.mark.parametrize("gather", GATHERS)
@pytest.mark.parametrize(("case", "ids", "make_chunks", "field"), BAD_BATCHES)
def test_bad_gather_raises_invalid_argument_and_writes_nothing(
    gather: Callable[..., None],
    case: str,
    ids: Any,
    make_chunks: Callable[[PagedKVCache], list[Any]],
    field: str,
) -> None:
    kv = make_cache()
    before = [layer.clone() for layer in kv.layers]
    outs = make_chunks(kv)
    outs_before = [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]
    with pytest.raises(InvalidArgument) as err:
        gather(kv, ids, outs)
    assert err.value.field is not None
    assert err.value.field.endswith(field), (case, err.value.field)
    for o, b in zip(outs, outs_before, strict=True):
        if isinstance(o, torch.Tensor):
            assert torch.equal(o, b), case
    assert_cache_unchanged(kv, before)


@pytest.mark.parametrize("scatter", SCATTERS)
@pytest.mark.parametrize(("case", "ids", "make_chunks", "field"), BAD_BATCHES)
def test_bad_scatter_raises_invalid_argument_and_writes_nothing(
    scatter: Callable[..., None],
    case: str,
    ids: Any,
    make_chunks: Callable[[PagedKVCache], list[Any]],
    field: str,
) -> None:
    kv = make_cache()
    before = [layer.clone() for layer in kv.layers]
    with pytest.raises(InvalidArgument) as err:
        scatter(kv, ids, make_chunks(kv))
    assert err.value.field is not None
    assert err.value.field.endswith(field), (case, err.value.field)
    assert_cache_unchanged(kv, before)


def test_too_few_block_ids_carries_a_machine_readable_reason() -> None:
    kv = make_cache()
    with pytest.raises(InvalidArgument) as err:
        gather_chunks(kv, [[0, 1]], [chunk(kv, 9)])  # 9 tokens at block_size 4 need 3 blocks
    assert err.value.reason == "TOO_FEW_BLOCK_IDS"
    assert "need 3" in err.value.message


@pytest.mark.parametrize("scatter", SCATTERS)
def test_scatter_rejects_a_block_written_twice(scatter: Callable[..., None]) -> None:
    kv = make_cache()
    before = [layer.clone() for layer in kv.layers]
    with pytest.raises(InvalidArgument) as err:
        scatter(kv, [[2, 3], [4, 3]], [chunk(kv, 8), chunk(kv, 8)])
    assert err.value.reason == "DUPLICATE_BLOCK_ID"
    assert_cache_unchanged(kv, before)


def test_a_skipped_block_may_repeat_a_written_one() -> None:
    """Only written blocks must be distinct: skipped ones are never touched."""
    kv = make_cache()
    scatter_chunks(kv, [[3, 3]], [chunk(kv, 8)], skip_first_n_tokens=4)


@pytest.mark.parametrize("scatter", SCATTERS)
@pytest.mark.parametrize("skip", [-1, 1.5, True])
def test_scatter_rejects_a_bad_skip(scatter: Callable[..., None], skip: Any) -> None:
    kv = make_cache()
    before = [layer.clone() for layer in kv.layers]
    with pytest.raises(InvalidArgument) as err:
        scatter(kv, [[0]], [chunk(kv, 4)], skip_first_n_tokens=skip)
    assert err.value.field == "skip_first_n_tokens"
    assert_cache_unchanged(kv, before)


def test_a_skip_past_the_whole_batch_writes_nothing() -> None:
    kv = make_cache()
    before = [layer.clone() for layer in kv.layers]
    scatter_chunks(kv, [[0, 1]], [chunk(kv, 8)], skip_first_n_tokens=100)
    assert_cache_unchanged(kv, before)


def test_an_empty_batch_is_a_no_op() -> None:
    kv = make_cache()
    gather_chunks(kv, [], [])
    scatter_chunks(kv, [], [])


def _fa(num_blocks: int = NUM_BLOCKS) -> list[int]:
    return list(paged_layer_shape(KVLayoutKind.FLASH_ATTN, num_blocks, BS, 2, 4))


FA = KVLayoutKind.FLASH_ATTN
BAD_CACHES: list[tuple[str, Callable[[], Any], Any]] = [
    ("no_layers", lambda: [], FA),
    ("one_tensor_not_a_list", lambda: torch.zeros(_fa()), FA),
    ("flash_attn_dim0_not_2", lambda: [torch.zeros(3, 8, 4, 2, 4)], FA),
    ("flashinfer_dim1_not_2", lambda: [torch.zeros(_fa())], KVLayoutKind.FLASHINFER),
    ("mla_rank_5", lambda: [torch.zeros(_fa())], KVLayoutKind.MLA),
    ("empty_dim", lambda: [torch.zeros(2, 0, 4, 2, 4)], FA),
    ("layers_differ_in_shape", lambda: [torch.zeros(_fa()), torch.zeros(_fa(9))], FA),
    ("layers_differ_in_dtype", lambda: [torch.zeros(_fa()), torch.zeros(_fa()).half()], FA),
    ("unsupported_dtype", lambda: [torch.zeros(_fa(), dtype=torch.int64)], FA),
    ("not_contiguous", lambda: [torch.zeros(2, 8, 4, 4, 2).transpose(3, 4)], FA),
    ("kind_is_a_string", lambda: [torch.zeros(_fa())], "flash_attn"),
]


@pytest.mark.parametrize(("case", "make_layers", "kind"), BAD_CACHES)
def test_bad_paged_cache_is_rejected(case: str, make_layers: Callable[[], Any], kind: Any) -> None:
    with pytest.raises(InvalidArgument):
        PagedKVCache(make_layers(), kind)
