"""TransferEngine over real shared-memory files: register again, unregister, close.

What each does to the mappings and to later copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.kernels import KVLayoutKind, gather_chunks, ref_gather_chunks
from kvmesh.storage.core.transfer.engine import TransferEngine
from kvmesh.storage.core.transfer.layout import chunk_shape
from kvmesh.storage.core.transfer.shm import SharedMemoryHandle
from tests.support.memory import resident_bytes
from tests.unit.storage.transfer.support import (
    cuda_handle,
    make_layout,
    make_shm_kv,
    mapped_paths,
    mapping_count,
)


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
    assert len(mapped_paths(shm_root)) == 1  # still mapped once
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
    assert mapped_paths(shm_root) == [kv.handles[0].path]
    assert mapping_count(kv.handles[0].path) == 1


def test_unregister_unmaps_and_later_copies_fail_precondition(
    engine: TransferEngine, shm_root: Path
) -> None:
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout, "file_per_layer")
    engine.register("engine-0", layout, kv.handles)
    assert len(mapped_paths(shm_root)) == 2

    engine.unregister("engine-0")

    assert not mapped_paths(shm_root)
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
    assert len(mapped_paths(shm_root)) == 2
    eng.close()
    assert eng.instance_ids() == []
    assert not mapped_paths(shm_root)


def test_cuda_handles_on_a_node_without_cuda_fail_precondition(
    engine: TransferEngine,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this node has CUDA; the CUDA path is exercised by the IPC test")
    with pytest.raises(FailedPrecondition) as err:
        engine.register("engine-0", make_layout(), [cuda_handle(), cuda_handle()])
    assert err.value.reason == "NO_CUDA_DEVICE"


def test_allowed_directory_must_exist(shm_root: Path) -> None:
    with pytest.raises(InvalidArgument):
        TransferEngine(shm_root / "missing")


def test_memory_held_by_a_copy_in_flight_outlives_unregister(
    engine: TransferEngine, shm_root: Path
) -> None:
    """Unregister never unmaps under a running copy: the copy's reference keeps it mapped."""
    layout = make_layout()
    kv = make_shm_kv(shm_root / "allowed", layout)
    engine.register("engine-0", layout, kv.handles)
    in_flight = engine._instance("engine-0").kv  # what a running copy holds
    engine.unregister("engine-0")

    assert mapped_paths(shm_root) == [kv.handles[0].path]
    out = torch.zeros(chunk_shape(layout, 16), dtype=layout.dtype)
    gather_chunks(in_flight, [[2]], [out])  # still valid memory
    want = torch.zeros_like(out)
    ref_gather_chunks(kv.private_copy(), [[2]], [want])
    assert torch.equal(out, want)

    del in_flight
    assert not mapped_paths(shm_root)


def test_prefault_maps_every_page_of_a_sparse_kv_file_and_changes_no_byte(
    engine: TransferEngine, shm_root: Path
) -> None:
    """An engine's KV file whose pages nobody touched yet (ftruncate only): prefault
    allocates and maps them here, so the first copies pay no page faults."""
    layout = make_layout(KVLayoutKind.VLLM_CPU, num_layers=2, num_blocks=64, block_size=16)
    path = shm_root / "allowed" / "sparse_kv"
    size = layout.layer_nbytes
    with path.open("wb") as f:
        f.truncate(2 * size)
    handles = [SharedMemoryHandle(str(path), i * size, size) for i in range(2)]
    engine.register("sparse", layout, handles)
    assert resident_bytes(str(path)) == 0
    assert path.stat().st_blocks == 0

    assert engine.prefault("sparse") >= 2 * size
    assert resident_bytes(str(path)) >= 2 * size
    assert path.stat().st_blocks * 512 >= 2 * size
    assert path.read_bytes() == bytes(2 * size)
    assert engine.prefault("unknown") == 0
