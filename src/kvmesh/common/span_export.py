"""Where finished spans go: JSON lines (a file or stdout), and quiet exporter failures.

:class:`JsonLinesSpanExporter` writes one compact JSON object per span —
trace id, span id, parent, name, kind, service, start, duration, status,
attributes and events — to a file opened for appending (several processes of
a fleet share one file: each batch is one ``write`` on an ``O_APPEND``
descriptor, so lines never interleave) or to stdout. One trace is then
``grep TRACE_ID spans.jsonl`` or ``jq 'select(.trace_id == "…")'``.

:class:`QuietExporter` wraps an exporter whose destination may be down (an
OTLP collector). Its first failure is logged once, at WARNING, with the
cause; while it keeps failing, one line at most every ``report_every_s``
counts what was dropped; the first success after failures is logged at INFO.
The OTLP exporters' own per-batch warnings (one every few seconds while a
collector is gone, even with no user traffic: heartbeats are traced) are
taken off the log and folded into that report.

The OpenTelemetry SDK is imported here only: this module is loaded when a
service turns tracing on, never by a client that leaves it off.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)

#: Loggers of the OTLP exporters whose per-batch failure records QuietExporter folds in.
EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp",)


def _hex(value: int, width: int) -> str:
    return f"{value:0{width}x}"


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the flat, greppable object a line of the trace file holds."""
    context = span.get_span_context()
    parent = span.parent
    start = span.start_time or 0
    end = span.end_time or start
    resource = span.resource.attributes if span.resource is not None else {}
    record: dict[str, Any] = {
        "trace_id": _hex(context.trace_id, 32) if context is not None else "",
        "span_id": _hex(context.span_id, 16) if context is not None else "",
        "parent_id": _hex(parent.span_id, 16) if parent is not None else "",
        "name": span.name,
        "kind": span.kind.name,
        "service": str(resource.get("service.name", "")),
        "start": _iso(start),
        "duration_ms": round((end - start) / 1e6, 3),
        "status": span.status.status_code.name,
    }
    if span.status.description:
        record["status_message"] = span.status.description
    if span.attributes:
        record["attributes"] = {k: _plain(v) for k, v in span.attributes.items()}
    if span.events:
        record["events"] = [
            {
                "name": event.name,
                "time": _iso(event.timestamp),
                **({"attributes": {k: _plain(v) for k, v in event.attributes.items()}}
                   if event.attributes else {}),
            }
            for event in span.events
        ]  # fmt: skip
    return record


def _iso(nanos: int) -> str:
    seconds, rest = divmod(int(nanos), 1_000_000_000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return f"{stamp}.{rest // 1000:06d}Z"


def _plain(value: Any) -> Any:
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Sequence):
        return [_plain(v) for v in value]
    return str(value)


class JsonLinesSpanExporter(SpanExporter):
    """Spans as JSON lines, appended to a file (shared by processes) or written to a stream."""

    def __init__(self, path: str | None = None, stream: TextIO | None = None) -> None:
        self.path = path
        self._stream = stream
        self._fd: int | None = None
        self._lock = threading.Lock()
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    @property
    def target(self) -> str:
        """Where the spans go, for the log."""
        return self.path if self.path is not None else "stdout"

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            if self._fd is not None:
                data = text.encode()
                # One write per batch: O_APPEND keeps a batch whole beside other writers.
                written = os.write(self._fd, data)
                while written < len(data):
                    written += os.write(self._fd, data[written:])
            else:
                stream = self._stream if self._stream is not None else sys.stdout
                stream.write(text)
                stream.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _Fold(logging.Filter):
    """Takes the OTLP exporters' warnings off the log, keeping their messages for the report."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if message not in self.messages and len(self.messages) < 4:
            self.messages.append(message)
        return False

    def take(self) -> str:
        """What the exporter said since the last call, as one line."""
        text = "; ".join(self.messages)
        self.messages = []
        return text if len(text) <= 400 else text[:397] + "..."


class QuietExporter(SpanExporter):
    """Logs an exporter's failures once, then at most every ``report_every_s`` seconds."""

    def __init__(
        self,
        inner: SpanExporter,
        target: str,
        *,
        report_every_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.target = target
        self.report_every_s = report_every_s
        self._clock = clock
        self._fold = _Fold()
        self._failing = False
        self._last_report = 0.0
        self._dropped_batches = 0
        self._dropped_spans = 0
        self._lock = threading.Lock()
        # Only an OTLP exporter's own records are folded in (and by its wrapper only).
        self._folds = type(inner).__module__.startswith(EXPORTER_LOGGERS)
        if self._folds:
            for name in _exporter_logger_names():
                logging.getLogger(name).addFilter(self._fold)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
            cause = self._fold.take()
        except Exception as exc:  # an exporter must never take the batch thread down
            result = SpanExportResult.FAILURE
            cause = f"{type(exc).__name__}: {exc}"
            self._fold.take()
        with self._lock:
            if result is SpanExportResult.SUCCESS:
                self._recovered()
            else:
                self._failed(len(spans), cause)
        return result

    def _failed(self, spans: int, cause: str) -> None:
        now = self._clock()
        self._dropped_batches += 1
        self._dropped_spans += spans
        if not self._failing:
            self._failing = True
            self._last_report = now
            logger.warning(
                "cannot export spans to %s (%s); dropping them while it fails, "
                "reported again at most every %.0f s",
                self.target,
                cause or "the exporter gave no reason",
                self.report_every_s,
            )
        elif now - self._last_report >= self.report_every_s:
            logger.warning(
                "still cannot export spans to %s: %d batches (%d spans) dropped so far (%s)",
                self.target,
                self._dropped_batches,
                self._dropped_spans,
                cause or "no reason given",
            )
            self._last_report = now

    def _recovered(self) -> None:
        if self._failing:
            logger.info(
                "exporting spans to %s again (%d batches, %d spans were dropped)",
                self.target,
                self._dropped_batches,
                self._dropped_spans,
            )
        self._failing = False
        self._dropped_batches = 0
        self._dropped_spans = 0

    @property
    def failing(self) -> bool:
        """True between a failed export and the next successful one."""
        return self._failing

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            if self._folds:
                for name in _exporter_logger_names():
                    logging.getLogger(name).removeFilter(self._fold)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _exporter_logger_names() -> list[str]:
    """The OTLP exporters' loggers that exist now (a filter applies to its own logger only)."""
    names = [
        name
        for name in logging.root.manager.loggerDict
        if any(name == root or name.startswith(root + ".") for root in EXPORTER_LOGGERS)
    ]
    return sorted(names)
