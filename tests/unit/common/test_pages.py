"""populate: every page of a range mapped for writing, a few MiB per kernel call."""

from __future__ import annotations

import ctypes
import mmap

import pytest

from kvmesh.common import pages


def _resident(mapping: mmap.mmap) -> int:
    """Pages of ``mapping`` in memory now (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    address = ctypes.addressof(view)
    del view
    count = -(-len(mapping) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * count)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(mapping)), vec) == 0
    return sum(b & 1 for b in vec)


def test_every_page_is_populated_also_past_the_last_whole_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pages, "POPULATE_STEP_BYTES", 1 << 20)
    size = 3 * (1 << 20) + 5 * mmap.PAGESIZE  # three steps and a partial one
    mapping = mmap.mmap(-1, size)
    try:
        assert _resident(mapping) == 0
        view = (ctypes.c_char * size).from_buffer(mapping)
        address = ctypes.addressof(view)
        del view
        if not pages.populate(address, size):
            pytest.fail("MADV_POPULATE_WRITE is missing (Linux >= 5.14 is required here)")
        assert _resident(mapping) == size // mmap.PAGESIZE
    finally:
        mapping.close()
