"""What a node's own metrics say about the calls a benchmark made: where a load's time went.

A benchmark scrapes the node (or its storage and gateway processes) before and
after it runs, and reports per call kind (lookup, retrieve, store) how many
calls the node served, its handler's mean time and a bound on its slowest call
(the smallest bucket of ``kvmesh_rpc_latency_seconds`` that holds them all)
and, for the data path, the copy's own mean time and throughput
(``kvmesh_storage_copy_*_total``, docs/observability.md), and the store calls
that waited for L1 to grow (``kvmesh_storage_l1_growth_waits_total``). The handler's time
less the copy's is locks, the hand-off to a copy thread and back, and the
event loop's wait for a core. ``loop`` says how often the node's event loop
woke a timer 20 ms and 100 ms late or more, and a bound on the longest lag
(``kvmesh_event_loop_lag_seconds``): every call waited through such a stall.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
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
            # A bound on the slowest call: one slow call hides in a mean.
            "handler_ms_at_most": _at_most_ms(
                delta, after, "kvmesh_rpc_latency_seconds", calls, method=method
            ),
        }
        if kind == "retrieve":
            # Loads the engine's scheduler started (RetrieveAhead) and Retrieves that
            # joined one: a joined Retrieve's handler time is the worker's wait only.
            row["started_ahead"] = int(delta("kvmesh_gateway_retrieves_ahead_total"))
            row["joined"] = int(delta("kvmesh_gateway_retrieves_joined_total"))
        if kind == "store":
            # Store calls that waited for L1 to map and populate a new segment.
            row["growth_waits"] = int(delta("kvmesh_storage_l1_growth_waits_total"))
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
    out["loop"] = _loop_lag(delta, after)
    return out


def _loop_lag(delta: Callable[..., float], after: Mapping[SampleKey, float]) -> dict[str, Any]:
    """The event loop's late wake-ups between the scrapes (summed over the pages scraped)."""
    name = "kvmesh_event_loop_lag_seconds"
    wake_ups = delta(f"{name}_count")
    bounds = _bounds(after, name)

    def late(at_least: float) -> int:
        within = delta(f"{name}_bucket", le=_le(at_least)) if at_least in bounds else wake_ups
        return int(wake_ups - within)

    return {
        "wake_ups": int(wake_ups),
        "late_20ms": late(0.02),
        "late_100ms": late(0.1),
        "longest_at_most_ms": _at_most_ms(delta, after, name, wake_ups),
    }


def _bounds(after: Mapping[SampleKey, float], name: str, **labels: str) -> list[float]:
    """The finite bucket bounds of histogram ``name`` (series with ``labels``)."""
    wanted = set(labels.items())
    return sorted(
        {
            float(dict(ls)["le"])
            for (n, ls), _ in after.items()
            if n == f"{name}_bucket"
            and wanted <= set(ls)
            and dict(ls).get("le") not in (None, "+Inf")
        }
    )


def _at_most_ms(
    delta: Callable[..., float],
    after: Mapping[SampleKey, float],
    name: str,
    count: float,
    **labels: str,
) -> float | None:
    """The smallest bucket bound of ``name`` that holds all ``count`` observations made
    between the scrapes, in ms; None with none, or when some lie beyond the last bound."""
    if not count:
        return None
    for bound in _bounds(after, name, **labels):
        if delta(f"{name}_bucket", le=_le(bound), **labels) >= count:
            return round(bound * 1e3, 1)
    return None


def _le(bound: float) -> str:
    """A bucket's ``le`` label as prometheus_client writes it."""
    return repr(float(bound))


def describe(node: Mapping[str, Mapping[str, Any]]) -> str:
    """One line of :func:`figures` for a benchmark's table."""
    parts = []
    for kind in _METHODS:
        row = node.get(kind) or {}
        if not row.get("calls"):
            continue
        text = f"{kind} {row['calls']}× {row['handler_ms_mean']} ms"
        if row.get("handler_ms_at_most") is not None:
            text += f" (slowest ≤ {row['handler_ms_at_most']} ms)"
        if row.get("started_ahead"):
            text += f", {row['joined']} joined a load started ahead"
        if row.get("growth_waits"):
            text += f", {row['growth_waits']} waited for L1 to grow"
        if row.get("copy_ms_mean") is not None:
            text += (
                f" (copy {row['copy_ms_mean']} ms of {row['copy_mb_mean']} MB, "
                f"{row['copy_gb_s']} GB/s)"
            )
        parts.append(text)
    text = "node handlers: " + ("; ".join(parts) if parts else "no calls")
    loop = node.get("loop") or {}
    if loop.get("wake_ups"):
        longest = loop.get("longest_at_most_ms")
        text += (
            f"; event loop late ≥ 20 ms {loop['late_20ms']}×, ≥ 100 ms {loop['late_100ms']}×"
            + (f" (longest ≤ {longest} ms)" if longest is not None else " (longest > 10 s)")
        )
    return text
