"""TransferEngine over real shared-memory files: gather and scatter against the reference.

The oracle for copies is the kernels' reference run on a private copy of the
file's bytes; results are read back from the file itself.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels import KVLayoutKind, ref_gather_chunks, ref_scatter_chunks
from kvmesh.storage.core.transfer.engine import TransferEngine
from kvmesh.storage.core.transfer.layout import KVLayout, chunk_nbytes, chunk_shape
from tests.unit.storage.transfer.support import LAYOUTS, make_layout, make_shm_kv, random_chunk

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FILE_SPLITS = ["one_file", "file_per_layer"]
BUFFER_KINDS = ["chunk_tensor", "flat_tensor", "uint8_tensor", "bytearray", "numpy", "memoryview"]


def as_buffer(chunk: torch.Tensor, kind: str) -> Any:
    """``chunk`` in one of the accepted buffer forms, sharing or copying its bytes."""
    if kind == "chunk_tensor":
        return chunk
    if kind == "flat_tensor":
        return chunk.reshape(-1)
    raw = chunk.reshape(-1).view(torch.uint8)
    if kind == "uint8_tensor":
        return raw
    if kind == "bytearray":
        return bytearray(raw.numpy().tobytes())
    if kind == "numpy":
        return raw.numpy().copy()
    return memoryview(bytearray(raw.numpy().tobytes()))


def buffer_as_chunk(buf: Any, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        raw = buf.reshape(-1).view(torch.uint8)
    else:
        raw = torch.frombuffer(bytearray(bytes(buf)), dtype=torch.uint8)
    return raw.view(layout.dtype).view(chunk_shape(layout, num_tokens))


GRID = list(itertools.product(LAYOUTS, DTYPES, FILE_SPLITS))


@pytest.mark.parametrize(("kind", "dtype", "split"), GRID)
def test_gather_from_shared_memory_matches_reference(
    engine: TransferEngine, shm_root: Path, kind: KVLayoutKind, dtype: torch.dtype, split: str
) -> None:
    layout = make_layout(kind, dtype)
    kv = make_shm_kv(shm_root / "allowed", layout, split)
    engine.register("engine-0", layout, kv.handles)
    tokens = [32, 21]  # a full two-block chunk and a partial last chunk
    outs = [torch.zeros(chunk_shape(layout, n), dtype=dtype) for n in tokens]
    want = [torch.zeros_like(o) for o in outs]

    engine.gather_chunks("engine-0", [[5, 2], [7, 0]], tokens, outs)
    ref_gather_chunks(kv.private_copy(), [[5, 2], [7, 0]], want)

    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))


@pytest.mark.parametrize("skip", [0, 19, 40])
@pytest.mark.parametrize(("kind", "dtype", "split"), GRID)
def test_scatter_into_shared_memory_matches_reference(
    engine: TransferEngine,
    shm_root: Path,
    kind: KVLayoutKind,
    dtype: torch.dtype,
    split: str,
    skip: int,
) -> None:
    layout = make_layout(kind, dtype)
    kv = make_shm_kv(shm_root / "allowed", layout, split)
    engine.register("engine-0", layout, kv.handles)
    tokens = [32, 21]
    srcs = [random_chunk(layout, n, seed=i) for i, n in enumerate(tokens)]
    expected = kv.private_copy()
    ref_scatter_chunks(expected, [[5, 2], [7, 0]], srcs, skip_first_n_tokens=skip)

    engine.scatter_chunks("engine-0", [[5, 2], [7, 0]], tokens, srcs, skip_first_n_tokens=skip)

    got = kv.layers_from_files()
    assert all(torch.equal(a, b) for a, b in zip(got, expected.layers, strict=True))


@pytest.mark.parametrize("buffer_kind", BUFFER_KINDS)
def test_every_buffer_form_round_trips(
    engine: TransferEngine, shm_root: Path, buffer_kind: str
) -> None:
    layout = make_layout(KVLayoutKind.FLASHINFER, torch.float16)
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    src = random_chunk(layout, 24, seed=3)
    engine.scatter_chunks("engine-0", [[6, 1]], [24], [as_buffer(src, buffer_kind)])

    out = as_buffer(torch.zeros_like(src), buffer_kind)
    engine.gather_chunks("engine-0", [[6, 1]], [24], [out])
    assert torch.equal(buffer_as_chunk(out, layout, 24), src)


def test_read_only_bytes_are_accepted_as_scatter_sources(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    src = random_chunk(layout, 16, seed=4)
    engine.scatter_chunks("engine-0", [[3]], [16], [src.view(torch.uint8).numpy().tobytes()])
    out = torch.zeros_like(src)
    engine.gather_chunks("engine-0", [[3]], [16], [out])
    assert torch.equal(out, src)


def test_flat_block_ids_split_per_chunk_like_per_chunk_lists(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout(KVLayoutKind.MLA, torch.bfloat16)
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    tokens = [32, 32, 5]
    per_chunk = [[1, 4], [6, 3], [0]]
    flat_forms: list[Any] = [
        [1, 4, 6, 3, 0],
        [1, 4, 6, 3, 0, 7],  # longer than needed: the tail is ignored
        torch.tensor([1, 4, 6, 3, 0], dtype=torch.int32),
        np.array([1, 4, 6, 3, 0]).tolist(),
    ]
    want = [torch.zeros(chunk_shape(layout, n), dtype=layout.dtype) for n in tokens]
    engine.gather_chunks("engine-0", per_chunk, tokens, want)
    for form in flat_forms:
        outs = [torch.zeros_like(w) for w in want]
        engine.gather_chunks("engine-0", form, tokens, outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))


def test_copies_never_touch_bytes_outside_the_registered_regions(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout(KVLayoutKind.FLASH_ATTN, torch.float32, num_blocks=4)
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    path = kv.handles[0].path
    before = Path(path).read_bytes()
    # Write every block of every layer.
    engine.scatter_chunks("engine-0", [[0, 1, 2, 3]], [64], [random_chunk(layout, 64, seed=5)])
    after = Path(path).read_bytes()

    regions = [(h.offset_bytes, h.offset_bytes + h.size_bytes) for h in kv.handles]
    outside = np.ones(len(before), dtype=bool)
    for lo, hi in regions:
        outside[lo:hi] = False
    b = np.frombuffer(before, dtype=np.uint8)
    a = np.frombuffer(after, dtype=np.uint8)
    assert np.array_equal(a[outside], b[outside])
    assert not np.array_equal(a[~outside], b[~outside])


def test_chunk_size_helpers_agree_with_the_kernels() -> None:
    layout = make_layout(KVLayoutKind.FLASH_ATTN, torch.bfloat16, num_layers=32)
    assert chunk_shape(layout, 256) == (2, 32, 256, 16)
    assert chunk_nbytes(layout, 256) == 2 * 32 * 256 * 16 * 2
    mla = make_layout(KVLayoutKind.MLA, "float32", num_layers=3)
    assert chunk_shape(mla, 7) == (1, 3, 7, 8)
    assert chunk_nbytes(mla, 7) == 3 * 7 * 8 * 4
    with pytest.raises(InvalidArgument):
        chunk_shape(layout, 0)


def test_concurrent_copies_of_one_instance_are_each_correct(
    engine: TransferEngine, shm_root: Path
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    layout = make_layout(num_blocks=16)
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    reference = kv.private_copy()
    jobs = [[[b, (b + 5) % 16]] for b in range(16)]

    def gather(ids: list[list[int]]) -> torch.Tensor:
        out = torch.zeros(chunk_shape(layout, 32), dtype=layout.dtype)
        engine.gather_chunks("engine-0", ids, [32], [out])
        return out

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(gather, jobs))
    for ids, got in zip(jobs, results, strict=True):
        want = torch.zeros_like(got)
        ref_gather_chunks(reference, ids, [want])
        assert torch.equal(got, want)
