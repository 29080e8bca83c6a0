"""``kvmesh traces FILE [TRACE_ID]``: read the spans a fleet wrote with ``--trace-file``.

Without a trace id it lists the latest traces, one line each (id, start,
root span, spans, services, duration); with one (or a unique prefix of one)
it prints that trace as a tree, parent above child, each span with its
kind, service, duration and status — one engine call read end to end
across gateway → storage → coordinator, without Docker or a collector.

The file holds one JSON object per span (src/kvmesh/common/span_export.py);
spans whose parent is not in the file (a process killed before it flushed)
are shown as roots.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvmesh.common.config import ConfigError, read_text_file
from kvmesh.common.telemetry import TracingSettingsError, tracing_settings


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans of a trace file; ConfigError when it cannot be read or a line is not a span."""
    text = read_text_file(path, "trace file")
    spans = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            span = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"trace file {path}, line {number}: not JSON") from None
        if not isinstance(span, dict) or not {"trace_id", "span_id", "name"} <= span.keys():
            raise ConfigError(f"trace file {path}, line {number}: not a span")
        spans.append(span)
    return spans


def _by_trace(spans: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    for members in traces.values():
        members.sort(key=lambda s: str(s.get("start", "")))
    return traces


def _roots(members: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ids = {s["span_id"] for s in members}
    return [s for s in members if s.get("parent_id", "") not in ids]


def summary(spans: list[dict[str, Any]], limit: int = 20) -> list[str]:
    """One line per trace, latest last."""
    traces = sorted(_by_trace(spans).items(), key=lambda item: str(item[1][0].get("start", "")))
    lines = []
    for trace_id, members in traces[-limit:]:
        root = _roots(members)[0]
        services = sorted({str(s.get("service", "")) for s in members})
        lines.append(
            f"{trace_id}  {root.get('start', '?')}  {root['name']}  "
            f"{len(members)} spans  {', '.join(services)}  {root.get('duration_ms', 0):.3f} ms"
        )
    return lines


def tree(spans: list[dict[str, Any]], trace_id: str) -> list[str]:
    """The trace whose id starts with ``trace_id``, as an indented tree."""
    traces = _by_trace(spans)
    matches = [t for t in traces if t.startswith(trace_id.lower())]
    if len(matches) != 1:
        found = "no trace" if not matches else f"{len(matches)} traces"
        raise ConfigError(f"{found} in the file with an id starting {trace_id!r}")
    members = traces[matches[0]]
    children: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in members:
        children[span.get("parent_id", "")].append(span)
    services = sorted({str(s.get("service", "")) for s in members})
    lines = [f"trace {matches[0]}: {len(members)} spans, {', '.join(services)}"]

    def walk(span: dict[str, Any], depth: int) -> None:
        system = (span.get("attributes") or {}).get("rpc.system", "")
        status = span.get("status", "UNSET")
        lines.append(
            f"{'  ' * depth}{span['name']}  {span.get('kind', '?')}  {span.get('service', '?')}"
            f"  {span.get('duration_ms', 0):.3f} ms"
            + (f"  [{system}]" if system else "")
            + (f"  {status}: {span.get('status_message', '')}" if status == "ERROR" else "")
        )
        for child in children.get(span["span_id"], []):
            walk(child, depth + 1)

    for root in _roots(members):
        walk(root, 1)
    return lines


def checked_trace_file(path: Path | None) -> Path | None:
    """``kvmesh up --trace-file``, made absolute and checked before any service starts.

    An unsupported OTEL_* variable fails here too, as one line, rather than in
    every child. ConfigError when the file cannot be appended to.
    """
    try:
        tracing_settings()
    except TracingSettingsError as exc:
        raise ConfigError(str(exc)) from None
    if path is None:
        return None
    path = path.resolve()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise ConfigError(f"--trace-file {path}: cannot append to it ({exc.strerror})") from None
    return path


def add_traces_command(sub: Any) -> None:
    """Register ``kvmesh traces``."""
    p = sub.add_parser(
        "traces",
        help="read a --trace-file: list its traces, or print one as a tree",
        description="Read the spans kvmesh up --trace-file (or KVMESH_TRACE_FILE) wrote: "
        "without TRACE_ID, list the latest traces; with it, print that trace as a tree.",
    )
    p.add_argument("file", type=Path, help="the trace file (one JSON line per span)")
    p.add_argument("trace_id", nargs="?", default="", help="a trace id, or a unique prefix")
    p.add_argument("--limit", type=int, default=20, help="traces listed (default: 20)")
    p.set_defaults(handler=run_traces)


def run_traces(args: argparse.Namespace) -> int:
    """Handler of ``kvmesh traces``."""
    spans = read_spans(args.file)
    lines = tree(spans, args.trace_id) if args.trace_id else summary(spans, args.limit)
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0
