"""What a node's own metrics say about the calls a benchmark made: where a load's time went.

A benchmark scrapes the node (or its storage and gateway processes) before and
after it runs, and reports per call kind (lookup, retrieve, store) how many
calls the node served, its handler's mean time (``kvmesh_rpc_latency_seconds``)
and, for the data path, the copy's own mean time and throughput
(``kvmesh_storage_copy_*_total``, docs/observability.md). The handler's time
less the copy's is locks, the hand-off to a copy thread and back, and the
event loop's wait for a core.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

#: One sample: (series name, its labels as sorted (name, value) pairs).
SampleKey = tuple[str, tuple[tuple[str, str], ...]]

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
#: The RPC method of each call kind, on a node (or on a gateway of its own).
_METHODS = {"lookup": "Lookup", "retrieve": "Retrieve", "store": "Store"}


def parse(text: str) -> dict[SampleKey, float]:
    """Samples of a Prometheus text page, keyed by name and labels."""
    out: dict[SampleKey, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        try:
            number = float(value)
        except ValueError:
            continue
        key = (name, tuple(sorted(_LABEL.findall(labels))))
        out[key] = out.get(key, 0.0) + number
    return out


def scrape(urls: Iterable[str]) -> dict[SampleKey, float]:
    """The samples of every page in ``urls``, summed; an unreachable page adds nothing."""
    out: dict[SampleKey, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            continue
        for key, value in parse(text).items():
            out[key] = out.get(key, 0.0) + value
    return out


def accumulate(
    into: dict[SampleKey, float],
    before: Mapping[SampleKey, float],
    after: Mapping[SampleKey, float],
) -> None:
    """Add what changed from ``before`` to ``after`` into ``into`` (phases of several rounds
    summed; :func:`figures` of ``({}, into)`` then reads them)."""
    for key, value in after.items():
        into[key] = into.get(key, 0.0) + value - before.get(key, 0.0)


def _total(samples: Mapping[SampleKey, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def figures(
    before: Mapping[SampleKey, float], after: Mapping[SampleKey, float]
) -> dict[str, dict[str, Any]]:
    """Per call kind, what the node did between two scrapes (see the module docstring)."""

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    out: dict[str, dict[str, Any]] = {}
    for kind, method in _METHODS.items():
        calls = delta("kvmesh_rpc_latency_seconds_count", method=method)
        seconds = delta("kvmesh_rpc_latency_seconds_sum", method=method)
        row: dict[str, Any] = {
            "calls": int(calls),
            "handler_ms_mean": round(1e3 * seconds / calls, 2) if calls else None,
        }
        if kind == "retrieve":
            # Loads the engine's scheduler started (RetrieveAhead) and Retrieves that
            # joined one: a joined Retrieve's handler time is the worker's wait only.
            row["started_ahead"] = int(delta("kvmesh_gateway_retrieves_ahead_total"))
            row["joined"] = int(delta("kvmesh_gateway_retrieves_joined_total"))
        if kind != "lookup":
            copies = delta("kvmesh_storage_copies_total", direction=kind)
            copy_s = delta("kvmesh_storage_copy_seconds_total", direction=kind)
            copy_bytes = delta("kvmesh_storage_copy_bytes_total", direction=kind)
            row.update(
                {
                    "copies": int(copies),
                    "copy_ms_mean": round(1e3 * copy_s / copies, 2) if copies else None,
                    "copy_mb_mean": round(copy_bytes / copies / 1e6, 2) if copies else None,
                    "copy_gb_s": round(copy_bytes / copy_s / 1e9, 2) if copy_s > 0 else None,
                }
            )
        out[kind] = row
    return out


def describe(node: Mapping[str, Mapping[str, Any]]) -> str:
    """One line of :func:`figures` for a benchmark's table."""
    parts = []
    for kind in _METHODS:
        row = node.get(kind, {})
        if not row.get("calls"):
            continue
        text = f"{kind} {row['calls']}× {row['handler_ms_mean']} ms"
        if row.get("started_ahead"):
            text += f", {row['joined']} joined a load started ahead"
        if row.get("copy_ms_mean") is not None:
            text += (
                f" (copy {row['copy_ms_mean']} ms of {row['copy_mb_mean']} MB, "
                f"{row['copy_gb_s']} GB/s)"
            )
        parts.append(text)
    return "node handlers: " + ("; ".join(parts) if parts else "no calls")
