"""The figures of ``kvmesh bench lookup`` as a small table."""

from __future__ import annotations

from typing import Any


def format_table(result: dict[str, Any]) -> str:
    """The figures as a small table."""
    lines = [
        f"lookup of a {result['chunks']}-chunk prefix ({result['tokens']} tokens) through the "
        f"gateway, {result['iterations']} iterations",
        f"headline ({result['headline_arrangement']}): lookup p50 {result['lookup_p50_ms']:.3f} ms"
        f", p99 {result['lookup_p99_ms']:.3f} ms; empty round trip p50 "
        f"{result['empty_rtt_p50_ms']:.3f} ms; target p50 <= {result['target_lookup_p50_ms']} ms"
        f" ({'met' if result['meets_target'] else 'NOT met'})",
        "engine -> gateway: " + result["parameters"]["transport"].split(": ", 1)[1],
        "",
        f"{'':22}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}",
    ]
    for name, figures in result["arrangements"].items():
        lines.append(f"[{name}]")
        for op in ("lookup", "end_session", "relookup", "get_chunk_size", "ping"):
            f = figures[op]
            lines.append(
                f"  {op:20}{f['p50_ms']:>9.3f}{f['p90_ms']:>9.3f}{f['p99_ms']:>9.3f}"
                f"{f['mean_ms']:>9.3f}"
            )
        server = figures["server_mean_ms"]
        for side in ("gateway", "storage"):
            parts = ", ".join(f"{m} {v:.3f}" for m, v in server[side].items())
            lines.append(f"  {side} handler mean ms: {parts}")
    profile = result.get("profile")
    if profile:
        lines += [
            "",
            f"profile: {profile['note']}",
            f"  (profiled lookup p50 {profile['profiled_lookup_p50_ms']:.3f} ms)",
        ]
        for side in ("client", "gateway", "storage"):
            if side not in profile:
                continue
            busy = ", ".join(f"{k} {v:.0f}" for k, v in profile[side]["busy_us_per_lookup"].items())
            lines.append(f"  {side}: busy µs per lookup: {busy}")
            for row in profile[side]["top_kvmesh_functions"]:
                lines.append(
                    f"    {row['own_us_per_lookup']:>7.1f} own {row['cum_us_per_lookup']:>7.1f}"
                    f" cum µs  {row['function']}"
                )
    return "\n".join(lines)
