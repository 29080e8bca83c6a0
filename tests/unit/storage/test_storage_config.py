"""The storage node's settings: the copy_threads default and its validation."""

from __future__ import annotations

import pytest

from kvmesh.common.config import ConfigError
from kvmesh.storage.config import StorageConfig


def test_copy_threads_default_to_one_per_core() -> None:
    config = StorageConfig()
    assert config.copy_threads == 0  # the app sizes the executor: one per core, 2 to 8
    config.validate()


@pytest.mark.parametrize("threads", [0, 1, 16])
def test_copy_threads_of_zero_or_more_are_valid(threads: int) -> None:
    StorageConfig(copy_threads=threads).validate()


def test_negative_copy_threads_are_refused() -> None:
    with pytest.raises(ConfigError, match="copy_threads must be >= 0"):
        StorageConfig(copy_threads=-1).validate()


def test_a_store_copies_on_one_thread_by_default() -> None:
    config = StorageConfig()
    assert config.store_copy_threads == 1
    StorageConfig(store_copy_threads=0).validate()  # 0 = as many as a load's copy
    with pytest.raises(ConfigError, match="store_copy_threads must be >= 0"):
        StorageConfig(store_copy_threads=-1).validate()
