"""The extent allocator: alignment, best-fit, coalescing, and no fragmentation under churn."""

from __future__ import annotations

import itertools
import random

import pytest

from kvmesh.storage.core.l1.allocator import ExtentAllocator

MIB = 1 << 20
CHUNK = 32 * MIB  # a full chunk: 256 tokens x 32 layers x 8 heads x 128 x bf16
SEGMENT = 256 * MIB


def assert_consistent(alloc: ExtentAllocator, segments: dict[int, int]) -> None:
    """No two live extents overlap, all lie inside their segment and are aligned."""
    extents = alloc.allocated_extents()
    by_seg: dict[int, list[tuple[int, int]]] = {}
    for seg, off, cap in extents:
        assert off % 4096 == 0
        assert cap % 4096 == 0
        assert off >= 0
        assert off + cap <= segments[seg]
        by_seg.setdefault(seg, []).append((off, cap))
    for spans in by_seg.values():
        spans.sort()
        for (a_off, a_cap), (b_off, _) in itertools.pairwise(spans):
            assert a_off + a_cap <= b_off, "overlapping allocations"
    assert alloc.used_bytes == sum(cap for _, _, cap in extents)


def test_sizes_are_rounded_up_to_the_alignment() -> None:
    alloc = ExtentAllocator()
    alloc.add_segment(0, 64 * 4096)
    seg, off, cap = alloc.allocate(1) or (None, None, None)
    assert (seg, off, cap) == (0, 0, 4096)
    _, off2, cap2 = alloc.allocate(4097) or (None, None, None)
    assert off2 == 4096
    assert cap2 == 8192
    assert alloc.used_bytes == 3 * 4096


def test_full_chunks_pack_from_the_bottom_and_partial_chunks_from_the_top() -> None:
    alloc = ExtentAllocator()
    alloc.add_segment(0, 8 * CHUNK)
    full = [alloc.allocate(CHUNK) for _ in range(3)]
    partial = [alloc.allocate(CHUNK // 4 + 1) for _ in range(3)]
    assert [p[1] for p in full if p] == [0, CHUNK, 2 * CHUNK]
    offsets = [p[1] for p in partial if p]
    assert offsets == sorted(offsets, reverse=True)
    assert min(offsets) > 5 * CHUNK, "partial chunks sit at the top of the segment"
    # A hole left by an evicted full chunk is refilled by a full chunk, not split
    # by a partial one that arrives first.
    assert full[1] is not None
    alloc.free(0, full[1][1])
    small = alloc.allocate(4096)
    assert small is not None
    assert small[1] > 3 * CHUNK
    assert alloc.allocate(CHUNK) == (0, CHUNK, CHUNK)


def test_a_fixed_size_class_overrides_the_learned_one() -> None:
    alloc = ExtentAllocator(large_bytes=CHUNK)
    alloc.add_segment(0, 4 * CHUNK)
    assert alloc.is_large(CHUNK)
    assert not alloc.is_large(CHUNK - 4096)
    alloc.allocate(64 * MIB)  # a bigger object does not move the boundary
    assert alloc.is_large(CHUNK)


def test_freed_neighbours_coalesce_into_one_extent() -> None:
    alloc = ExtentAllocator()
    alloc.add_segment(0, SEGMENT)
    parts = [alloc.allocate(4 * MIB) for _ in range(8)]
    assert all(parts)
    assert alloc.allocate(SEGMENT) is None
    order = list(range(8))
    random.Random(7).shuffle(order)
    for i in order:
        p = parts[i]
        assert p is not None
        alloc.free(p[0], p[1])
    assert alloc.free_extent_count == 1
    assert alloc.largest_free_extent == SEGMENT
    assert alloc.allocate(SEGMENT) == (0, 0, SEGMENT)


def test_an_object_never_spans_two_segments() -> None:
    alloc = ExtentAllocator()
    alloc.add_segment(0, 3 * MIB)
    alloc.add_segment(1, 3 * MIB)
    assert alloc.allocate(2 * MIB) is not None
    assert alloc.allocate(2 * MIB) is not None
    # 2 MiB free in total, but 1 MiB in each segment: a 2 MiB object cannot fit.
    assert alloc.free_bytes == 2 * MIB
    assert alloc.allocate(2 * MIB) is None
    assert not alloc.would_fit([2 * MIB])
    assert alloc.would_fit([MIB, MIB])


def test_double_free_is_refused() -> None:
    alloc = ExtentAllocator()
    alloc.add_segment(0, MIB)
    placed = alloc.allocate(4096)
    assert placed is not None
    alloc.free(placed[0], placed[1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(placed[0], placed[1])


def test_would_fit_matches_what_allocate_then_does() -> None:
    rng = random.Random(3)
    alloc = ExtentAllocator()
    alloc.add_segment(0, 64 * MIB)
    alloc.add_segment(1, 64 * MIB)
    live = []
    for _ in range(40):
        p = alloc.allocate(rng.choice([MIB, 3 * MIB, 8 * MIB]))
        if p:
            live.append(p)
    for p in live[::2]:
        alloc.free(p[0], p[1])
    for sizes in ([8 * MIB] * 3, [16 * MIB], [MIB] * 20, [32 * MIB, 8 * MIB]):
        expected = alloc.would_fit(sizes)
        got = []
        for s in sorted(sizes, reverse=True):
            p = alloc.allocate(s)
            if p is None:
                break
            got.append(p)
        assert (len(got) == len(sizes)) == expected
        for p in got:
            alloc.free(p[0], p[1])


def test_churn_of_full_and_partial_chunks_does_not_fragment() -> None:
    """Random stores and evictions: no overlap ever, and freed memory takes full chunks again."""
    rng = random.Random(1234)
    segments = {0: SEGMENT, 1: SEGMENT}
    alloc = ExtentAllocator()
    for seg, size in segments.items():
        alloc.add_segment(seg, size)
    live: list[tuple[int, int, int]] = []
    full_refusals_with_room = 0
    full_attempts = 0
    for step in range(6000):
        if live and (rng.random() < 0.45 or alloc.free_bytes < CHUNK):
            seg, off, _ = live.pop(rng.randrange(len(live)))
            alloc.free(seg, off)
        else:
            # 70 % full chunks, 30 % partial chunks of any size (the last chunk of a prompt).
            size = CHUNK if rng.random() < 0.7 else rng.randint(1, CHUNK - 1)
            placed = alloc.allocate(size)
            full_attempts += size == CHUNK
            if placed is not None:
                live.append(placed)
            elif size == CHUNK and alloc.free_bytes >= 3 * CHUNK:
                full_refusals_with_room += 1
        if step % 500 == 0:
            assert_consistent(alloc, segments)
    assert_consistent(alloc, segments)
    # Keeping partial chunks apart means a full chunk is (almost) never refused
    # while three full chunks' worth of memory is free (plain first-fit: ~4 %).
    assert full_refusals_with_room <= full_attempts // 100
    # Free every partial chunk: the memory they used coalesces, so full chunks fit
    # wherever a full chunk's worth was freed.
    for seg, off, cap in [p for p in live if p[2] < CHUNK]:
        alloc.free(seg, off)
        live.remove((seg, off, cap))
    # At most one full chunk's worth per segment is lost to misalignment.
    fits = alloc.free_bytes // CHUNK - len(segments)
    assert alloc.would_fit([CHUNK] * fits)
    for seg, off, _ in live:
        alloc.free(seg, off)
    assert alloc.used_bytes == 0
    assert alloc.free_extent_count == len(segments)
    assert alloc.largest_free_extent == SEGMENT
