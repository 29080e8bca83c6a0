"""The L1 pool: shared-memory segments, lazy growth, mapping by another process, cleanup."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import pytest
import torch

from kvmesh.common.errors import FailedPrecondition, InvalidArgument
from kvmesh.storage.core.l1.pool import L1Pool, segment_prefix
from tests.unit.storage.helpers import MIB


def test_segments_are_named_after_the_node_and_live_in_the_shm_dir(
    make_pool: Callable[..., L1Pool], shm_dir: str
) -> None:
    pool = make_pool(8 * MIB, name="node/a:1")
    paths = pool.segment_paths()
    assert paths == [os.path.join(shm_dir, "kvmesh-l1-node_a_1-0")]
    assert os.path.getsize(paths[0]) == 4 * MIB
    assert pool.committed_bytes == 4 * MIB
    assert pool.capacity_bytes == 8 * MIB


def test_object_bytes_are_shared_with_another_mapping_of_its_location(
    make_pool: Callable[..., L1Pool],
) -> None:
    pool = make_pool(8 * MIB)
    obj = pool.allocate(10_000)
    assert obj is not None
    assert obj.size == 10_000
    assert obj.capacity == 12_288
    view = obj.view()
    assert view.nbytes == 10_000
    assert not view.readonly
    view[:4] = b"kvkv"
    tensor = obj.tensor()
    assert tensor.dtype == torch.uint8
    assert tensor.numel() == 10_000
    tensor[4:8] = torch.tensor(list(b"mesh"), dtype=torch.uint8)
    loc = obj.location()
    assert loc.offset % 4096 == 0
    with open(loc.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as other:
        assert other[loc.offset : loc.offset + 8] == b"kvkvmesh"
        other[loc.offset + 8 : loc.offset + 10] = b"!!"
    assert bytes(obj.view()[8:10]) == b"!!"


def test_pool_grows_synchronously_up_to_capacity_and_no_further(
    make_pool: Callable[..., L1Pool],
) -> None:
    pool = make_pool(10 * MIB)  # segments of 4, 4 and 2 MiB
    assert pool.committed_bytes == 4 * MIB
    assert pool.grow_for([4 * MIB, 4 * MIB])
    assert pool.committed_bytes == 8 * MIB
    assert pool.grow_for([4 * MIB, 4 * MIB, 2 * MIB])
    assert pool.committed_bytes == 10 * MIB
    assert len(pool.segment_paths()) == 3
    assert not pool.grow_for([4 * MIB] * 3)
    assert pool.committed_bytes == 10 * MIB


def test_background_growth_starts_at_the_watermark(make_pool: Callable[..., L1Pool]) -> None:
    pool = make_pool(12 * MIB, background_grow=True, grow_watermark=0.5)
    assert pool.committed_bytes == 4 * MIB
    first = pool.allocate(MIB)
    assert first is not None
    assert not pool.wait_committed(8 * MIB, timeout=0.05), "grew below the watermark"
    second = pool.allocate(MIB)  # 2 of 4 MiB used: at the watermark
    assert second is not None
    assert pool.wait_committed(8 * MIB, timeout=10)


def test_background_growth_keeps_half_a_segment_of_headroom(
    make_pool: Callable[..., L1Pool],
) -> None:
    """Whatever the watermark, less than half a segment free starts the next growth."""
    pool = make_pool(12 * MIB, background_grow=True, grow_watermark=0.95)
    first = pool.allocate(2 * MIB)  # 2 MiB free of 4: not yet
    assert first is not None
    assert not pool.wait_committed(8 * MIB, timeout=0.05), "grew with half a segment free"
    second = pool.allocate(MIB // 2)  # 1.5 MiB free, below the watermark's 95 %
    assert second is not None
    assert pool.wait_committed(8 * MIB, timeout=10)


def test_background_growth_keeps_the_largest_expected_reservation_free(
    make_pool: Callable[..., L1Pool],
) -> None:
    """A store larger than half a segment: the grower keeps that much free ahead."""
    pool = make_pool(16 * MIB, background_grow=True, grow_watermark=0.95)
    pool.expect_reservation([MIB, 2 * MIB - 100])  # aligned: 3 MiB
    first = pool.allocate(3 * MIB // 2)  # 2.5 MiB free: half a segment, not 3 MiB
    assert first is not None
    assert pool.wait_committed(8 * MIB, timeout=10)
    # 6.5 MiB free now covers the next 3 MiB store: no further segment.
    assert not pool.wait_committed(12 * MIB, timeout=0.05), "grew past the headroom"
    # A reservation larger than what is left to map keeps everything mapped.
    pool.expect_reservation([4 * MIB] * 16)
    second = pool.allocate(MIB)
    assert second is not None
    assert pool.wait_committed(16 * MIB, timeout=10)


def test_a_requested_growth_adds_a_segment_below_the_watermark(
    make_pool: Callable[..., L1Pool],
) -> None:
    pool = make_pool(12 * MIB, background_grow=True)
    assert pool.can_grow()
    pool.request_growth()
    assert pool.wait_committed(8 * MIB, timeout=10)


def test_allocation_fails_cleanly_when_full_and_memory_comes_back_on_free(
    make_pool: Callable[..., L1Pool],
) -> None:
    pool = make_pool(4 * MIB)
    objs = [pool.allocate(MIB) for _ in range(4)]
    assert all(objs)
    assert pool.allocate(1) is None
    assert pool.stats()["allocation_failures"] == 1
    first = objs[0]
    assert first is not None
    pool.free(first)
    assert first.released
    assert pool.allocate(MIB) is not None


def test_objects_larger_than_a_segment_are_invalid(make_pool: Callable[..., L1Pool]) -> None:
    pool = make_pool(8 * MIB)
    with pytest.raises(InvalidArgument, match="segment size"):
        pool.allocate(4 * MIB + 1)
    with pytest.raises(InvalidArgument):
        pool.allocate(0)


def test_double_free_is_ignored(make_pool: Callable[..., L1Pool]) -> None:
    pool = make_pool(4 * MIB)
    obj = pool.allocate(MIB)
    assert obj is not None
    pool.free(obj)
    pool.free(obj)
    assert pool.used_bytes == 0


def test_close_removes_every_file_of_the_pool(shm_dir: str) -> None:
    pool = L1Pool("n1", 8 * MIB, segment_bytes=4 * MIB, shm_dir=shm_dir, background_grow=False)
    pool.grow_for([4 * MIB, 4 * MIB])
    obj = pool.allocate(MIB)
    assert obj is not None
    held = obj.tensor()  # a live export must not block the cleanup
    assert len(os.listdir(shm_dir)) == 3  # two segments and the lock file
    pool.close()
    pool.close()
    assert os.listdir(shm_dir) == []
    del held


def test_an_object_tensor_keeps_its_memory_mapped_past_the_pools_close(shm_dir: str) -> None:
    pool = L1Pool("n1", 4 * MIB, segment_bytes=4 * MIB, shm_dir=shm_dir, background_grow=False)
    pool.grow_for([MIB])
    first, second = pool.allocate(MIB), pool.allocate(MIB)
    assert first is not None
    assert second is not None
    a, b = first.tensor(), second.tensor()
    # Slices of one tensor over the segment: the objects' bytes, and only theirs.
    assert a.data_ptr() + second.offset - first.offset == b.data_ptr()
    a.fill_(7)
    b.fill_(9)
    assert bytes(first.view()[:2]) == b"\x07\x07"
    assert bytes(second.view()[-2:]) == b"\t\t"
    pool.close()
    # A copy in flight still reads and writes mapped memory: the mapping goes with the
    # last tensor over it, not under it.
    assert int(a.sum()) == 7 * MIB
    assert int(b[-1]) == 9
    a[0] = 1
    del a, b


def test_stale_segments_of_the_same_node_are_removed_at_start(shm_dir: str) -> None:
    prefix = segment_prefix("n1")
    for name in (f"{prefix}-0", f"{prefix}-7", "kvmesh-l1-n1-b-0", "unrelated"):
        with open(os.path.join(shm_dir, name), "wb") as f:
            f.write(b"x")
    pool = L1Pool("n1", 4 * MIB, segment_bytes=4 * MIB, shm_dir=shm_dir, background_grow=False)
    try:
        names = sorted(os.listdir(shm_dir))
        assert f"{prefix}-7" not in names
        assert "kvmesh-l1-n1-b-0" in names, "another node's segment is left alone"
        assert "unrelated" in names
        assert os.path.getsize(os.path.join(shm_dir, f"{prefix}-0")) == 4 * MIB
    finally:
        pool.close()


def test_a_second_live_pool_with_the_same_name_is_refused(shm_dir: str) -> None:
    pool = L1Pool("n1", 4 * MIB, segment_bytes=4 * MIB, shm_dir=shm_dir, background_grow=False)
    try:
        with pytest.raises(FailedPrecondition, match="instance names must be unique"):
            L1Pool("n1", 4 * MIB, segment_bytes=4 * MIB, shm_dir=shm_dir, background_grow=False)
        assert os.path.exists(pool.segment_paths()[0]), "the live pool's memory is untouched"
    finally:
        pool.close()
