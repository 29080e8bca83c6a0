"""``kvmesh bench blend`` on SmolLM2 with every arrangement, reorder_vllm through real vLLM.

Small sizes (3 documents, 2 prompts): the figures are not the point here, the
invariants are. Ratio 1.0 is the full prefill; the reorder plan serves the
documents from kvmesh through unmodified vLLM.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.bench import blend
from kvmesh.cli.main import bench_parser

pytestmark = pytest.mark.slow


def test_every_arrangement_runs_on_smollm2_and_vllm_serves_the_reordered_documents(
    smollm2: Path,
) -> None:
    args = bench_parser("blend", blend).parse_args(
        ["--model", str(smollm2), "--documents", "3", "--docs-per-prompt", "2", "--prompts", "2",
         "--sentences", "8", "--generate", "8", "--ratios", "0,1", "--quiet"]
    )  # fmt: skip
    result = blend.run(args)
    rows = result["arrangements"]
    assert set(rows) == {"full_prefill", "prefix_only", "blend_0", "blend_1", "reorder_vllm"}
    assert result["not_run"] == {}
    assert rows["blend_1"]["greedy_agreement"] == 1.0
    assert rows["blend_1"]["first_token_kl"] == 0.0
    assert rows["blend_0"]["first_token_kl"] > 0  # no recompute: not the full prefill
    reorder = rows["reorder_vllm"]
    # Two ~150-token documents after a 21-token system prompt, 64-token chunks: all
    # but the chunk the question starts in comes from kvmesh.
    assert reorder["doc_token_fraction"] >= 0.6, reorder
    assert reorder["reused_token_fraction"] > 0.5, reorder
    assert reorder["ttft_mean_ms"] > 0
    assert "reorder_vllm" in blend.format_table(result)
