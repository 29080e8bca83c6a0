"""Engine tests run torch on one thread.

The machines have two cores shared with other suites; two OpenMP threads
fighting other processes for them are several times slower than one thread,
and the tests assert exactness, never speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.small_llama import write_small_llama


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder of a small random-weight Llama (float32), written by transformers."""
    return write_small_llama(tmp_path_factory.mktemp("small-llama"))
