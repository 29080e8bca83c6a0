"""Fixtures of the TransferEngine tests: a /dev/shm directory and an engine confined to it.

``shm_root`` holds ``allowed/`` (the engine's allowed directory) and
``outside/``; it is removed after the test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.storage.core.transfer.engine import TransferEngine

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
