"""Fixtures for the storage core tests: shm dirs, small pools, a fake clock, an L1 manager."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

from kvmesh.storage.core.l1.manager import L1Manager
from kvmesh.storage.core.l1.pool import L1Pool
from tests.unit.storage.helpers import MIB, FakeClock


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A unique directory under /dev/shm, removed (and checked for leftovers) afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="kvmesh-test-", dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_pool(shm_dir: str) -> Iterator[Callable[..., L1Pool]]:
    """Factory of small pools in the test's shm dir; every pool is closed afterwards."""
    pools: list[L1Pool] = []

    def make(capacity: int = 8 * MIB, **kwargs: object) -> L1Pool:
        kwargs.setdefault("segment_bytes", 4 * MIB)
        kwargs.setdefault("background_grow", False)
        kwargs.setdefault("shm_dir", shm_dir)
        name = str(kwargs.pop("name", f"t{len(pools)}"))
        pool = L1Pool(name, capacity, **kwargs)  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def l1(make_pool: Callable[..., L1Pool], clock: FakeClock) -> L1Manager:
    """An L1 manager over an 8 MiB pool fully committed up front, with a fake clock."""
    pool = make_pool(8 * MIB, initial_bytes=8 * MIB)
    return L1Manager(pool, clock=clock)
