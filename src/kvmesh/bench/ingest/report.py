"""The figures of ``kvmesh bench ingest`` as a small table."""

from __future__ import annotations

from typing import Any


def format_table(result: dict[str, Any]) -> str:
    """The figures as a readable table (one per run, then a one-line comparison)."""
    runs: list[dict[str, Any]] = result.get("runs", [result])
    tables = [_format_run(r) for r in runs]
    if len(runs) > 1:
        tables.append(
            "\n".join(
                f"window {r['window']:>3}, groups <= {r['group']:>3}: "
                f"{r['entries_per_s']:>10,.0f} entries/s, ack p99 {r['ack_p99_ms']:.2f} ms, "
                f"max stall {r['max_stall_ms']:.2f} ms"
                for r in runs
            )
        )
    return "\n\n".join(tables)


def _grouping(result: dict[str, Any]) -> str:
    if result["group"] <= 1:
        return "no groups"
    return (
        f"groups of <= {result['group']} batches "
        f"({result['batches_per_message']:.2f} batches per message)"
    )


def _format_run(result: dict[str, Any]) -> str:
    p = result["parameters"]
    t = result["targets"]
    met = result["targets_met"]

    def mark(name: str) -> str:
        return "ok" if met[name] else "MISSED"

    lines = [
        f"ingest: {p['emitters']} emitters x {p['batch_entries']}-entry STORE batches, "
        f"{p['keys']} keys, window {p['window']}, {_grouping(result)}, {p['cpus']} CPUs",
        "",
        f"{'entries/s':24} {result['entries_per_s']:>12,.0f}   target >= {t['entries_per_s']:,} "
        f"({mark('entries_per_s')})",
        f"{'ack p50 / p99 / max ms':24} {result['ack_p50_ms']:>6.2f} / {result['ack_p99_ms']:.2f}"
        f" / {result['ack_max_ms']:.2f}   p99 target <= {t['ack_p99_ms']} "
        f"({mark('ack_p99_ms')})",
        f"{'max stall ms':24} {result['max_stall_ms']:>12.2f}   target <= {t['max_stall_ms']} "
        f"({mark('max_stall_ms')}); per emitter "
        f"{result['max_stall_per_emitter_ms']:.2f}",
        f"{'lookup16 p50 / p99 ms':24} {result['lookup16_p50_ms']:>6.3f} / "
        f"{result['lookup16_p99_ms']:.3f}",
        f"{'bytes per key':24} {result['bytes_per_key']:>12.0f}   ({result['num_keys']:,} keys, "
        f"RSS {result['coordinator_rss_mb']:.0f} MB)",
        f"{'coordinator CPU s':24} {result['coordinator_cpu_s']:>12.2f}   "
        f"({result['entries_per_coordinator_cpu_s']:,.0f} entries per CPU second); "
        f"emitters {result['emitters_cpu_s']:.2f} s over {result['ingest_seconds']:.2f} s",
    ]
    return "\n".join(lines)
