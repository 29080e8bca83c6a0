"""The figures of ``kvmesh bench datapath`` as a readable table."""

from __future__ import annotations

from typing import Any

from .params import MIB


def format_table(result: dict[str, Any]) -> str:
    """The figures as a readable table."""
    p = result["parameters"]
    lines = [
        f"datapath: {result['chunks']} chunks x {result['chunk_bytes'] / MIB:.0f} MiB "
        f"({p['chunk_tokens']} tokens x {p['num_layers']} layers x {p['kv_heads']} heads x "
        f"{p['head_dim']} x {p['dtype']}, {p['layout']}, block {p['block_size']}), "
        f"{result['repetitions']} repetitions, {p['chunks_per_request']} chunks/request, "
        f"{p['copy_threads']} copy threads ({p['store_copy_threads']} for a store)",
        "",
        f"{'':10} {'median GB/s':>12} {'best GB/s':>10} {'vs memcpy':>10} {'best vs':>8}",
        f"{'memcpy':10} {result['memcpy_gbps']:>12.2f} {result['best_memcpy_gbps']:>10.2f}",
    ]
    for op in ("store", "retrieve"):
        lines.append(
            f"{op:10} {result[f'{op}_gbps']:>12.2f} {result[f'best_{op}_gbps']:>10.2f} "
            f"{result[f'{op}_ratio']:>10.3f} {result[f'best_{op}_ratio']:>8.3f}"
        )
    lines.append(f"{'cold store':10} {result['cold_store_gbps']:>12.2f}  (first round, see below)")
    lines += [
        f"{'gather*':10} {result['kernel_gather_gbps']:>12.2f}",
        f"{'scatter*':10} {result['kernel_scatter_gbps']:>12.2f}",
        "  * the copy kernels called directly, without gRPC or L1 bookkeeping",
        f"target: >= {result['target_ratio']:.0%} of memcpy",
        "",
        "where one round goes (ms, median round):",
    ]
    for op in ("store", "retrieve"):
        parts = ", ".join(f"{k} {v}" for k, v in result["breakdown_ms"][op].items())
        faults = result["minor_faults_per_round"][op]
        lines.append(f"  {op}: {parts}; minor faults {faults}")
    parts = ", ".join(f"{k} {v}" for k, v in result["cold_store_breakdown_ms"].items())
    faults = result["minor_faults_per_round"]["cold_store"]
    lines.append(f"  cold store: {parts}; minor faults {faults}")
    return "\n".join(lines)
