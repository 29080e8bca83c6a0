"""TransferEngine over real shared-memory files: registration checks, copies, bad inputs.

Every file lives in a temporary directory under /dev/shm that the tests remove.
The oracle for copies is the kernels' reference run on a private copy of the
file's bytes; results are read back from the file itself.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.kernels import (
    KVLayoutKind,
    PagedKVCache,
    gather_chunks,
    ref_gather_chunks,
    ref_scatter_chunks,
)
from kvmesh.storage.core.transfer.cuda_ipc import CudaIpcHandle
from kvmesh.storage.core.transfer.engine import TransferEngine
from kvmesh.storage.core.transfer.layout import KVLayout, chunk_nbytes, chunk_shape, parse_dtype
from kvmesh.storage.core.transfer.shm import SharedMemoryHandle

# ---- parameter grids ------------------------------------------------------------------------
LAYOUTS = list(KVLayoutKind)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FILE_SPLITS = ["one_file", "file_per_layer"]
BUFFER_KINDS = ["chunk_tensor", "flat_tensor", "uint8_tensor", "bytearray", "numpy", "memoryview"]

HEADER = 4096  # bytes before the first layer and between layers, never to be touched
TRAILER = 100

SHM_BASE = "/dev/shm" if os.path.isdir("/dev/shm") else None


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="kvmesh-transfer-test-", dir=SHM_BASE))
    (root / "allowed").mkdir()
    (root / "outside").mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root)


@pytest.fixture
def engine(shm_root: Path) -> Iterator[TransferEngine]:
    eng = TransferEngine(shm_root / "allowed")
    try:
        yield eng
    finally:
        eng.close()


def make_layout(
    kind: KVLayoutKind = KVLayoutKind.FLASH_ATTN,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    num_layers: int = 2,
    num_blocks: int = 8,
    block_size: int = 16,
) -> KVLayout:
    kv_heads = 1 if kind is KVLayoutKind.MLA else 2
    return KVLayout(kind, num_layers, num_blocks, block_size, kv_heads, 8, dtype)


@dataclass
class ShmKV:
    """Shared-memory files holding a layout's layers, with guard bytes around every layer."""

    layout: KVLayout
    handles: list[SharedMemoryHandle]

    def file_bytes(self) -> dict[str, bytes]:
        return {h.path: Path(h.path).read_bytes() for h in self.handles}

    def private_copy(self) -> PagedKVCache:
        """The layers as ordinary tensors, read from the files (not mapped)."""
        layers = []
        for h in self.handles:
            raw = Path(h.path).read_bytes()[h.offset_bytes : h.offset_bytes + h.size_bytes]
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            layers.append(t.view(self.layout.dtype).view(self.layout.layer_shape))
        return PagedKVCache(layers, self.layout.kind)

    def layers_from_files(self) -> list[torch.Tensor]:
        return list(self.private_copy().layers)


def make_shm_kv(directory: Path, layout: KVLayout, split: str = "one_file", seed: int = 0) -> ShmKV:
    rng = np.random.default_rng(seed)
    size = layout.layer_nbytes
    handles = []
    if split == "one_file":
        path = directory / "kv_cache"
        total = HEADER + layout.num_layers * (size + HEADER) + TRAILER
        path.write_bytes(_random_kv_bytes(rng, total, layout.dtype))
        handles = [
            SharedMemoryHandle(str(path), HEADER + i * (size + HEADER), size)
            for i in range(layout.num_layers)
        ]
    else:
        for i in range(layout.num_layers):
            path = directory / f"kv_layer_{i}"
            path.write_bytes(_random_kv_bytes(rng, HEADER + size + TRAILER, layout.dtype))
            handles.append(SharedMemoryHandle(str(path), HEADER, size))
    return ShmKV(layout, handles)


def _random_kv_bytes(rng: np.random.Generator, nbytes: int, dtype: torch.dtype) -> bytes:
    # Finite values of the dtype, so torch.equal comparisons mean byte equality.
    itemsize = torch.empty(0, dtype=dtype).element_size()
    values = torch.from_numpy(rng.standard_normal(nbytes // itemsize).astype(np.float32))
    return values.to(dtype).view(torch.uint8).numpy().tobytes() + b"\x00" * (nbytes % itemsize)


def random_chunk(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(chunk_shape(layout, num_tokens), generator=gen).to(layout.dtype)


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


# ---- copies ---------------------------------------------------------------------------------


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


# ---- registration -------------------------------------------------------------------------


def test_relative_names_resolve_inside_the_allowed_directory(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    relative = [SharedMemoryHandle("kv_cache", h.offset_bytes, h.size_bytes) for h in kv.handles]
    engine.register("engine-0", layout, relative)
    assert engine.is_registered("engine-0")
    assert engine.layout("engine-0") == layout


def test_a_symlink_that_stays_inside_the_allowed_directory_is_accepted(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    link = shm_root / "allowed" / "alias"
    link.symlink_to(kv.handles[0].path)
    handles = [SharedMemoryHandle(str(link), h.offset_bytes, h.size_bytes) for h in kv.handles]
    engine.register("engine-0", layout, handles)
    assert engine.is_registered("engine-0")


def _outside_file(shm_root: Path, layout: KVLayout) -> ShmKV:
    return make_shm_kv(shm_root / "outside", layout)


BadRegistration = Callable[[Path, KVLayout, ShmKV], tuple[KVLayout, list[Any]]]


def _swap(handles: list[SharedMemoryHandle], i: int, **changes: Any) -> list[Any]:
    out: list[Any] = list(handles)
    h = handles[i]
    out[i] = SharedMemoryHandle(
        changes.get("path", h.path),
        changes.get("offset_bytes", h.offset_bytes),
        changes.get("size_bytes", h.size_bytes),
    )
    return out


def _symlink_escape(root: Path, layout: KVLayout, kv: ShmKV) -> tuple[KVLayout, list[Any]]:
    target = _outside_file(root, layout)
    link = root / "allowed" / "escape"
    link.symlink_to(target.handles[0].path)
    return layout, _swap(kv.handles, 1, path=str(link))


def _directory(root: Path, layout: KVLayout, kv: ShmKV) -> tuple[KVLayout, list[Any]]:
    (root / "allowed" / "subdir").mkdir()
    return layout, _swap(kv.handles, 1, path=str(root / "allowed" / "subdir"), offset_bytes=0)


def _short_file(root: Path, layout: KVLayout, kv: ShmKV) -> tuple[KVLayout, list[Any]]:
    short = root / "allowed" / "short"
    short.write_bytes(b"\x00" * (layout.layer_nbytes - 2))
    return layout, _swap(kv.handles, 1, path=str(short), offset_bytes=0)


def _with_path(make: Callable[[Path, KVLayout], str]) -> BadRegistration:
    return lambda root, lay, kv: (lay, _swap(kv.handles, 1, path=make(root, lay)))


def _with_offset(make: Callable[[ShmKV], int]) -> BadRegistration:
    return lambda root, lay, kv: (lay, _swap(kv.handles, 1, offset_bytes=make(kv)))


def _with_handles(make: Callable[[ShmKV], Any]) -> BadRegistration:
    return lambda root, lay, kv: (lay, make(kv))


def _not_a_layout(kv: ShmKV) -> tuple[Any, list[Any]]:
    return {"kind": "mla"}, list(kv.handles)


BAD_REGISTRATIONS: list[tuple[str, BadRegistration, str]] = [
    (
        "path_outside_allowed_dir",
        _with_path(lambda root, lay: _outside_file(root, lay).handles[0].path),
        "handles[1].path",
    ),
    (
        "dot_dot_escape",
        _with_path(lambda root, lay: str(root / "allowed" / ".." / "outside" / "kv_cache")),
        "handles[1].path",
    ),
    (
        "dot_dot_that_stays_inside",
        _with_path(lambda root, lay: str(root / "allowed" / ".." / "allowed" / "kv_cache")),
        "handles[1].path",
    ),
    ("symlink_escape", _symlink_escape, "handles[1].path"),
    (
        "missing_file",
        _with_path(lambda root, lay: str(root / "allowed" / "nope")),
        "handles[1].path",
    ),
    (
        "the_allowed_dir_itself",
        _with_path(lambda root, lay: str(root / "allowed")),
        "handles[1].path",
    ),
    ("directory", _directory, "handles[1].path"),
    ("empty_path", _with_path(lambda root, lay: ""), "handles[1].path"),
    ("file_too_small", _short_file, "handles[1].size_bytes"),
    (
        "region_past_end_of_file",
        _with_offset(lambda kv: kv.handles[1].offset_bytes + 2 * HEADER),
        "handles[1].size_bytes",
    ),
    (
        "size_not_one_layer",
        lambda root, lay, kv: (lay, _swap(kv.handles, 1, size_bytes=lay.layer_nbytes - 2)),
        "handles[1].size_bytes",
    ),
    (
        "offset_not_dtype_aligned",
        _with_offset(lambda kv: kv.handles[1].offset_bytes + 1),
        "handles[1].offset_bytes",
    ),
    ("negative_offset", _with_offset(lambda kv: -2), "handles[1].offset_bytes"),
    (
        "overlapping_layers",
        _with_offset(lambda kv: kv.handles[0].offset_bytes + 64),
        "offset_bytes",
    ),
    ("too_few_handles", _with_handles(lambda kv: kv.handles[:1]), "handles"),
    ("too_many_handles", _with_handles(lambda kv: kv.handles + kv.handles[:1]), "handles"),
    ("mixed_handle_types", _with_handles(lambda kv: [kv.handles[0], _cuda_handle()]), "handles"),
    ("handles_not_a_sequence", _with_handles(lambda kv: "kv_cache"), "handles"),
    ("layout_not_a_kvlayout", lambda root, lay, kv: _not_a_layout(kv), "layout"),
]


@pytest.mark.parametrize(("case", "bad", "field"), BAD_REGISTRATIONS)
def test_bad_registration_is_rejected_and_registers_nothing(
    engine: TransferEngine, shm_root: Path, case: str, bad: BadRegistration, field: str
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    before = kv.file_bytes()
    bad_layout, handles = bad(shm_root, layout, kv)

    with pytest.raises(InvalidArgument) as err:
        engine.register("engine-0", bad_layout, handles)

    assert err.value.field is not None
    assert err.value.field.endswith(field), (case, err.value.field)
    assert not engine.is_registered("engine-0")
    assert kv.file_bytes() == before
    assert not _mapped_paths(shm_root)


def test_path_escape_carries_a_machine_readable_reason(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    _, handles = _symlink_escape(shm_root, layout, kv)
    with pytest.raises(InvalidArgument) as err:
        engine.register("engine-0", layout, handles)
    assert err.value.reason == "SHM_PATH_OUTSIDE_ALLOWED_DIR"


def _layout(**changes: Any) -> Callable[[], KVLayout]:
    fields: dict[str, Any] = {
        "kind": "flash_attn",
        "num_layers": 2,
        "num_blocks": 8,
        "block_size": 16,
        "kv_heads": 2,
        "head_dim": 8,
        "dtype": "bfloat16",
    }
    fields.update(changes)
    return lambda: KVLayout(**fields)


BAD_LAYOUTS: list[tuple[str, Callable[[], KVLayout], str]] = [
    ("zero_layers", _layout(num_layers=0), "layout.num_layers"),
    ("negative_blocks", _layout(num_blocks=-1), "layout.num_blocks"),
    ("zero_block_size", _layout(block_size=0), "layout.block_size"),
    ("bool_kv_heads", _layout(kv_heads=True), "layout.kv_heads"),
    ("float_head_dim", _layout(head_dim=8.0), "layout.head_dim"),
    ("huge_head_dim", _layout(head_dim=1 << 20), "layout.head_dim"),
    (
        "huge_layer",
        _layout(num_blocks=1 << 30, block_size=1024, kv_heads=64, head_dim=128),
        "layout",
    ),
    ("mla_with_heads", _layout(kind="mla"), "layout.kv_heads"),
    ("unknown_kind", _layout(kind="paged_hnd"), "layout.kind"),
    ("unsupported_dtype", _layout(dtype=torch.int64), "layout.dtype"),
    ("unknown_dtype_name", _layout(dtype="complex64"), "layout.dtype"),
]


@pytest.mark.parametrize(("case", "make", "field"), BAD_LAYOUTS)
def test_bad_layout_is_rejected_naming_the_field(
    case: str, make: Callable[[], KVLayout], field: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        make()
    assert err.value.field == field, case


def test_dtype_names_and_kind_names_are_normalized() -> None:
    by_name = KVLayout("FLASHINFER", 2, 8, 16, 2, 8, "torch.bfloat16")
    by_value = KVLayout(KVLayoutKind.FLASHINFER, 2, 8, 16, 2, 8, torch.bfloat16)
    assert by_name == by_value
    assert parse_dtype("fp8") == torch.float8_e4m3fn
    assert parse_dtype("half") == torch.float16


@pytest.mark.parametrize("bad_id", ["", None, 7])
def test_bad_instance_id_is_rejected(engine: TransferEngine, shm_root: Path, bad_id: Any) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    with pytest.raises(InvalidArgument) as err:
        engine.register(bad_id, layout, kv.handles)
    assert err.value.field == "instance_id"


def test_re_register_with_the_same_layout_is_a_no_op(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    engine.register("engine-0", make_layout(), list(kv.handles))
    assert engine.instance_ids() == ["engine-0"]
    assert len(_mapped_paths(shm_root)) == 1  # still mapped once
    out = torch.zeros(chunk_shape(layout, 16), dtype=layout.dtype)
    engine.gather_chunks("engine-0", [[1]], [16], [out])


def test_re_register_with_another_layout_fails_precondition(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    other = make_layout(dtype=torch.float16)
    with pytest.raises(FailedPrecondition) as err:
        engine.register("engine-0", other, kv.handles)
    assert err.value.reason == "INSTANCE_LAYOUT_MISMATCH"
    assert engine.layout("engine-0") == layout


def test_re_register_with_other_memory_fails_precondition(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    other = make_shm_kv(shm_root / "allowed", layout, "file_per_layer")
    with pytest.raises(FailedPrecondition) as err:
        engine.register("engine-0", layout, other.handles)
    assert err.value.reason == "INSTANCE_MEMORY_MISMATCH"


def test_one_file_is_mapped_once_for_all_layers(engine: TransferEngine, shm_root: Path) -> None:
    layout = make_layout(num_layers=4)
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    assert _mapped_paths(shm_root) == [kv.handles[0].path]
    assert _mapping_count(kv.handles[0].path) == 1


def test_unregister_unmaps_and_later_copies_fail_precondition(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout, "file_per_layer")
    engine.register("engine-0", layout, kv.handles)
    assert len(_mapped_paths(shm_root)) == 2

    engine.unregister("engine-0")

    assert not _mapped_paths(shm_root)
    assert not engine.is_registered("engine-0")
    out = torch.zeros(chunk_shape(layout, 16), dtype=layout.dtype)
    with pytest.raises(FailedPrecondition):
        engine.gather_chunks("engine-0", [[1]], [16], [out])


def test_unregister_of_an_unknown_instance_is_not_found(engine: TransferEngine) -> None:
    with pytest.raises(NotFound):
        engine.unregister("never-registered")
    with pytest.raises(NotFound):
        engine.layout("never-registered")


def test_store_and_retrieve_before_register_fail_precondition(engine: TransferEngine) -> None:
    layout = make_layout()
    out = torch.zeros(chunk_shape(layout, 16), dtype=layout.dtype)
    with pytest.raises(FailedPrecondition) as err:
        engine.gather_chunks("engine-0", [[1]], [16], [out])
    assert err.value.reason == "INSTANCE_NOT_REGISTERED"
    with pytest.raises(FailedPrecondition):
        engine.scatter_chunks("engine-0", [[1]], [16], [out])
    assert torch.count_nonzero(out.float()) == 0


def test_close_unregisters_and_unmaps_everything(shm_root: Path) -> None:
    eng = TransferEngine(shm_root / "allowed")
    for i in range(2):
        layout = make_layout()
        (shm_root / "allowed" / f"e{i}").mkdir()
        kv = make_shm_kv(shm_root / "allowed" / f"e{i}", layout)
        eng.register(f"engine-{i}", layout, kv.handles)
    assert len(_mapped_paths(shm_root)) == 2
    eng.close()
    assert eng.instance_ids() == []
    assert not _mapped_paths(shm_root)


def test_cuda_handles_on_a_node_without_cuda_fail_precondition(
    engine: TransferEngine,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this node has CUDA; the CUDA path is exercised by the IPC test")
    with pytest.raises(FailedPrecondition) as err:
        engine.register("engine-0", make_layout(), [_cuda_handle(), _cuda_handle()])
    assert err.value.reason == "NO_CUDA_DEVICE"


def test_allowed_directory_must_exist(shm_root: Path) -> None:
    with pytest.raises(InvalidArgument):
        TransferEngine(shm_root / "missing")


# ---- bad copy requests ----------------------------------------------------------------------

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


# ---- CUDA IPC (needs a GPU; the exporter is another process, as in production) ---------------


def _cuda_exporter(conn: Any, kind_name: str) -> None:  # pragma: no cover - child process
    layout = make_layout(KVLayoutKind[kind_name], torch.bfloat16)
    layers = [
        torch.randn(layout.layer_shape, device="cuda").to(layout.dtype)
        for _ in range(layout.num_layers)
    ]
    conn.send([CudaIpcHandle.from_tensor(t) for t in layers])
    conn.recv()  # the parent has scattered: send the layers back and exit
    conn.send([t.cpu() for t in layers])
    conn.recv()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_cuda_ipc_registration_round_trips_chunks(
    engine: TransferEngine, kind: KVLayoutKind
) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_cuda_exporter, args=(child, kind.name))
    proc.start()
    try:
        handles = parent.recv()
        layout = make_layout(kind, torch.bfloat16)
        engine.register("gpu-engine", layout, handles)
        src = random_chunk(layout, 21, seed=11)
        engine.scatter_chunks("gpu-engine", [[3, 6]], [21], [src], skip_first_n_tokens=0)
        out = torch.zeros_like(src)
        engine.gather_chunks("gpu-engine", [[3, 6]], [21], [out])
        assert torch.equal(out, src)
        engine.unregister("gpu-engine")
        parent.send("dump")
        exported = parent.recv()
        expected = PagedKVCache(exported, kind)
        check = torch.zeros_like(src)
        ref_gather_chunks(expected, [[3, 6]], [check])
        assert torch.equal(check, src)  # the bytes landed in the exporter's own memory
        parent.send("exit")
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


# ---- helpers --------------------------------------------------------------------------------


def _cuda_handle() -> CudaIpcHandle:
    layout = make_layout()
    numel = 1
    for d in layout.layer_shape:
        numel *= d
    stride = torch.empty(layout.layer_shape, device="meta").stride()
    return CudaIpcHandle(
        device_index=0,
        ipc_handle=b"\x01" * 64,
        storage_size_bytes=numel * 2,
        storage_offset_bytes=0,
        ref_counter_handle=b"ref",
        ref_counter_offset=0,
        event_handle=b"",
        event_sync_required=False,
        shape=layout.layer_shape,
        stride=tuple(stride),
        tensor_offset=0,
    )


def _maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return f.read().splitlines()


def _mapped_paths(root: Path) -> list[str]:
    """Distinct files under ``root`` this process has mapped (Linux /proc)."""
    prefix = str(root)
    paths = {line.split(maxsplit=5)[-1] for line in _maps() if prefix in line}
    return sorted(p for p in paths if p.startswith(prefix))


def _mapping_count(path: str) -> int:
    return sum(1 for line in _maps() if line.endswith(path))


def test_a_path_swapped_after_the_check_is_caught_on_the_opened_file(
    engine: TransferEngine, shm_root: Path
) -> None:
    """The race the pre-open check cannot see: a directory replaced by a symlink to elsewhere.

    ``_map_file`` is what runs after the path check passed; it must re-check
    the file it actually opened.
    """
    layout = make_layout()
    _outside_file(shm_root, layout)
    (shm_root / "allowed" / "swapped").symlink_to(shm_root / "outside")
    with pytest.raises(InvalidArgument) as err:
        engine._shm._map_file(str(shm_root / "allowed" / "swapped" / "kv_cache"), "handles[0].path")
    assert err.value.reason == "SHM_PATH_OUTSIDE_ALLOWED_DIR"
    assert not _mapped_paths(shm_root)


def test_memory_held_by_a_copy_in_flight_outlives_unregister(
    engine: TransferEngine, shm_root: Path
) -> None:
    """Unregister never unmaps under a running copy: the copy's reference keeps it mapped."""
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    in_flight = engine._instance("engine-0").kv  # what a running copy holds
    engine.unregister("engine-0")

    assert _mapped_paths(shm_root) == [kv.handles[0].path]
    out = torch.zeros(chunk_shape(layout, 16), dtype=layout.dtype)
    gather_chunks(in_flight, [[2]], [out])  # still valid memory
    want = torch.zeros_like(out)
    ref_gather_chunks(kv.private_copy(), [[2]], [want])
    assert torch.equal(out, want)

    del in_flight
    assert not _mapped_paths(shm_root)


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
