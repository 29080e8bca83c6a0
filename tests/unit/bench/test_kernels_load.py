"""``python -m kvmesh.bench.kernels_load``: a whole load into vLLM's CPU layouts beside memcpy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.bench import kernels_load
from kvmesh.kernels import KVLayoutKind


@pytest.mark.parametrize("kind", [KVLayoutKind.VLLM_CPU, KVLayoutKind.VLLM_CPU_AMX])
def test_one_shape_reports_the_copy_beside_memcpy_of_the_same_bytes(kind: KVLayoutKind) -> None:
    row = kernels_load.bench_shape("tiny", kind, threads=1, rounds=2, pool_bytes=32 << 20)
    # 24 chunks of 256 tokens x 4 layers x 2 planes x 2 heads x 64 dims in bf16.
    assert row["load_mib"] == 24 * 256 * 4 * 2 * 2 * 64 * 2 / 2**20
    assert (row["shape"], row["layout"], row["threads"]) == ("tiny", kind.name, 1)
    for step in ("scatter", "gather", "memcpy"):
        assert row[f"{step}_ms"] > 0
        assert row[f"{step}_gbps"] > 0
    assert row["scatter_vs_memcpy"] == round(row["scatter_gbps"] / row["memcpy_gbps"], 3)


def test_the_module_prints_json_with_a_row_per_layout_and_thread_count() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.bench.kernels_load", "--rounds", "1", "--shapes", "tiny",
         "--threads", "1", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout)
    rows = {(r["layout"], r["threads"]) for r in result["results"]}
    assert rows == {(k, n) for k in ("VLLM_CPU", "VLLM_CPU_AMX") for n in (1, 2)}
