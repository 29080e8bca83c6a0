"""``format_table`` of ``kvmesh bench route``."""

from __future__ import annotations

from typing import Any

RATIOS = (
    "score_vs_oracle_hit_ratio",
    "round_robin_vs_oracle_hit_ratio",
    "score_vs_round_robin_ttft_ratio",
)


def format_table(result: dict[str, Any]) -> str:
    """The figures as a table (only what this run measured)."""
    w = result["workload"]
    lines = [
        f"kvmesh bench route: {result['model']}; {len(result['engines'])} vLLM engines, each "
        f"with a kvmesh node; {w['groups']} groups x {w['requests_per_group']} requests of a "
        f"{w['prefix_tokens']}-token prefix + {w['suffix_tokens']} tokens, "
        f"{w['concurrency']} in flight; at best {w['reusable_tokens']} tokens cached per router",
        f"{'router':<12} {'hit tokens':>10} {'hit rate':>9} {'TTFT mean':>10} {'p50':>9} "
        f"{'p90':>9} {'round s':>8}  requests per engine",
    ]
    for name, r in result["routers"].items():
        spread = ", ".join(f"{e}: {n}" for e, n in r["requests_per_engine"].items())
        lines.append(
            f"{name:<12} {r['hit_tokens']:>10} {r['hit_rate']:>9.3f} {r['ttft_mean_ms']:>8.1f}ms "
            f"{r['ttft_p50_ms']:>7.1f}ms {r['ttft_p90_ms']:>7.1f}ms {r['round_s']:>8.2f}  {spread}"
        )
    score = result["routers"].get("score")
    if score:
        lines.append(
            f"ScoreEngines: {score['score_calls']} calls, {score['score_failed']} failed, "
            f"{score['score_informed']} with a cached prefix somewhere; "
            f"p50 {score['score_p50_ms']} ms, p99 {score['score_p99_ms']} ms"
        )
    lines.extend(f"{key}: {result[key]}" for key in RATIOS if key in result)
    return "\n".join(lines)
