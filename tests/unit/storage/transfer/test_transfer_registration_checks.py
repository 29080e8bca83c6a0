"""TransferEngine over real shared-memory files: what registration accepts and refuses.

Paths, symlinks, sizes, handles and layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels import KVLayoutKind
from kvmesh.storage.core.transfer.engine import TransferEngine
from kvmesh.storage.core.transfer.layout import KVLayout, parse_dtype
from kvmesh.storage.core.transfer.shm import SharedMemoryHandle
from tests.unit.storage.transfer.support import (
    HEADER,
    ShmKV,
    cuda_handle,
    make_layout,
    make_shm_kv,
    mapped_paths,
)


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
    ("mixed_handle_types", _with_handles(lambda kv: [kv.handles[0], cuda_handle()]), "handles"),
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
    assert not mapped_paths(shm_root)


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
    assert not mapped_paths(shm_root)


def _nameless_copy(directory: Path, kv: ShmKV) -> tuple[int, str]:
    """The bytes of ``kv``'s file in a nameless file of ``directory``: (fd, /proc path)."""
    import os

    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    os.write(fd, Path(kv.handles[0].path).read_bytes())
    return fd, f"/proc/{os.getpid()}/fd/{fd}"


def test_an_engines_nameless_file_is_opened_through_its_descriptor(
    engine: TransferEngine, shm_root: Path
) -> None:
    """vLLM's connector keeps its KV file nameless; storage maps it via /proc/<pid>/fd/<n>."""
    import os

    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    fd, path = _nameless_copy(shm_root / "allowed", kv)
    try:
        handles = [SharedMemoryHandle(path, h.offset_bytes, h.size_bytes) for h in kv.handles]
        engine.register("engine-0", layout, handles)
        assert engine.is_registered("engine-0")
        engine.unregister("engine-0")
    finally:
        os.close(fd)


def test_a_descriptor_of_a_file_outside_the_allowed_directory_is_refused(
    engine: TransferEngine, shm_root: Path
) -> None:
    import os

    layout = make_layout()
    kv = make_shm_kv(shm_root / "outside", layout)
    fd, path = _nameless_copy(shm_root / "outside", kv)
    try:
        handles = [SharedMemoryHandle(path, h.offset_bytes, h.size_bytes) for h in kv.handles]
        with pytest.raises(InvalidArgument, match="outside") as info:
            engine.register("engine-0", layout, handles)
        assert info.value.field == "handles[0].path"
    finally:
        os.close(fd)


def test_a_descriptor_that_no_longer_exists_is_refused_with_a_reason(
    engine: TransferEngine,
) -> None:
    layout = make_layout()
    size = layout.layer_nbytes
    handles = [SharedMemoryHandle("/proc/999999999/fd/3", 0, size)] * layout.num_layers
    with pytest.raises(InvalidArgument, match="the engine is gone"):
        engine.register("engine-0", layout, handles)
