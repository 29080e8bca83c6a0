"""TransferEngine over real shared-memory files: bad copy requests are refused, change nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.storage.core.transfer.engine import TransferEngine
from kvmesh.storage.core.transfer.layout import KVLayout, chunk_nbytes
from tests.unit.storage.transfer.support import make_layout, make_shm_kv, random_chunk

BadCopy = Callable[[KVLayout], tuple[Any, Any, list[Any], int]]


def _chunks(layout: KVLayout, *tokens: int) -> list[Any]:
    return [random_chunk(layout, n, seed=9 + i) for i, n in enumerate(tokens)]


def _copy(
    ids: Any, tokens: Any, chunk_tokens: tuple[int, ...], last: Callable[[Any], Any] | None = None
) -> BadCopy:
    """A copy request; ``last`` replaces the last buffer (made from a valid one)."""

    def make(layout: KVLayout) -> tuple[Any, Any, list[Any], int]:
        bufs = _chunks(layout, *chunk_tokens)
        if last is not None:
            bufs[-1] = last(bufs[-1])
        return ids, tokens, bufs, 0

    return make


BAD_COPIES: list[tuple[str, BadCopy, str]] = [
    ("block_id_out_of_range", _copy([[1], [8]], [16, 16], (16, 16)), "block_ids[1]"),
    ("negative_block_id", _copy([[1], [-1]], [16, 16], (16, 16)), "block_ids[1]"),
    ("too_few_ids_per_chunk", _copy([[1], [2]], [16, 17], (16, 17)), "block_ids[1]"),
    ("too_few_ids_flat", _copy([1, 2], [16, 17], (16, 17)), "block_ids"),
    ("id_lists_vs_chunks", _copy([[1]], [16, 16], (16, 16)), "block_ids"),
    ("num_tokens_vs_buffers", _copy([[1], [2]], [16], (16, 16)), "num_tokens"),
    ("zero_tokens", _copy([[1], [2]], [16, 0], (16, 16)), "num_tokens[1]"),
    ("buffer_size_mismatch", _copy([[1], [2]], [16, 15], (16, 16)), "[1]"),
    ("wrong_dtype_tensor", _copy([[1], [2]], [16, 16], (16, 16), lambda c: c.float()), "[1]"),
    (
        "wrong_shape_tensor",
        _copy([[1], [2]], [16, 16], (16, 16), lambda c: c.reshape(4, 16, 16)),
        "[1]",
    ),
    ("not_a_buffer", _copy([[1], [2]], [16, 16], (16, 16), lambda c: object()), "[1]"),
    ("duplicate_written_block", _copy([[1], [1]], [16, 16], (16, 16)), "block_ids[1]"),
]


@pytest.mark.parametrize(("case", "bad", "field"), BAD_COPIES)
def test_bad_scatter_is_rejected_and_the_cache_is_unchanged(
    engine: TransferEngine, shm_root: Path, case: str, bad: BadCopy, field: str
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    before = kv.file_bytes()
    ids, tokens, srcs, skip = bad(layout)
    with pytest.raises(InvalidArgument) as err:
        engine.scatter_chunks("engine-0", ids, tokens, srcs, skip_first_n_tokens=skip)
    assert err.value.field is not None
    assert err.value.field.endswith(field), (case, err.value.field)
    assert kv.file_bytes() == before


# Reading one block twice is harmless: only scatter rejects duplicates.
BAD_GATHERS = [c for c in BAD_COPIES if c[0] != "duplicate_written_block"]


@pytest.mark.parametrize(("case", "bad", "field"), BAD_GATHERS)
def test_bad_gather_is_rejected_and_the_buffers_are_unchanged(
    engine: TransferEngine, shm_root: Path, case: str, bad: BadCopy, field: str
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    before = kv.file_bytes()
    ids, tokens, outs, _ = bad(layout)
    outs_before = [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]
    with pytest.raises(InvalidArgument) as err:
        engine.gather_chunks("engine-0", ids, tokens, outs)
    assert err.value.field is not None
    assert err.value.field.endswith(field), (case, err.value.field)
    for o, b in zip(outs, outs_before, strict=True):
        if isinstance(o, torch.Tensor):
            assert torch.equal(o, b), case
    assert kv.file_bytes() == before


def test_negative_skip_is_rejected_and_the_cache_is_unchanged(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    before = kv.file_bytes()
    with pytest.raises(InvalidArgument) as err:
        engine.scatter_chunks("engine-0", [[1]], [16], _chunks(layout, 16), -16)
    assert err.value.field == "skip_first_n_tokens"
    assert kv.file_bytes() == before


@pytest.mark.parametrize("not_a_list", [None, b"\x00" * 64])
def test_buffers_must_come_as_a_list(
    engine: TransferEngine, shm_root: Path, not_a_list: Any
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    with pytest.raises(InvalidArgument) as err:
        engine.gather_chunks("engine-0", [[1]], [16], not_a_list)
    assert err.value.field == "outs"
    with pytest.raises(InvalidArgument) as err:
        engine.scatter_chunks("engine-0", [[1]], [16], not_a_list)
    assert err.value.field == "srcs"


def test_read_only_buffers_are_refused_as_gather_destinations(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    read_only = bytes(chunk_nbytes(layout, 16))
    with pytest.raises(InvalidArgument) as err:
        engine.gather_chunks("engine-0", [[1]], [16], [read_only])  # type: ignore[list-item]
    assert err.value.field == "outs[0]"
    assert read_only == bytes(len(read_only))


def test_a_cuda_event_for_shared_memory_kv_is_rejected_and_nothing_moves(
    engine: TransferEngine, shm_root: Path
) -> None:
    """``producer_event_handle`` orders copies against a GPU stream: on shm KV it is a mistake."""
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    before = kv.file_bytes()
    (chunk,) = _chunks(layout, 16)
    out = torch.zeros_like(chunk)
    with pytest.raises(InvalidArgument, match="CUDA device") as err:
        engine.scatter_chunks("engine-0", [[1]], [16], [chunk], producer_event=b"\x01" * 64)
    assert err.value.field == "producer_event_handle"
    with pytest.raises(InvalidArgument, match="CUDA device"):
        engine.gather_chunks("engine-0", [[1]], [16], [out], producer_event=b"\x01" * 64)
    assert kv.file_bytes() == before
    assert not out.any()
