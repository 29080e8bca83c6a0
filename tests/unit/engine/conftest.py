"""Engine tests run torch on one thread.

The machines have two cores shared with other suites; two OpenMP threads
fighting other processes for them are several times slower than one thread,
and the tests assert exactness, never speed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
