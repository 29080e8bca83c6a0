"""Logging and OpenTelemetry tracing setup shared by every service.

Tracing is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (spans are exported
over OTLP/gRPC in batches) or when a test installs its own tracer provider.
Otherwise no tracer provider is installed, the gRPC tracing interceptors are
not added, and the hot paths pay nothing for it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from opentelemetry import trace
from opentelemetry.context import Context

logger = logging.getLogger(__name__)

_tracing_lock = threading.Lock()
_tracing_configured = False

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(service)s] %(message)s"


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "service"):
            record.service = self.service
        return True


def configure_logging(service: str, level: str = "INFO") -> None:
    """One-line log records on stderr, tagged with the service name."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(_ServiceFilter(service))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())


def tracing_enabled() -> bool:
    """True when spans go somewhere: an OTLP endpoint, or a provider a caller installed."""
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return True
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def configure_tracing(service: str) -> bool:
    """Install an OTLP-exporting tracer provider if the environment asks for one.

    Returns whether tracing is enabled afterwards. Idempotent per process.
    """
    global _tracing_configured  # noqa: PLW0603 - process-wide, like the tracer provider itself
    with _tracing_lock:
        if _tracing_configured or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            return tracing_enabled()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": f"kvmesh-{service}"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _tracing_configured = True
        logger.info("exporting traces over OTLP to %s", os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
        return True


def current_trace_id() -> str:
    """Hex trace id of the active span, or '-' when there is none."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "-"
    return f"{ctx.trace_id:032x}"


def current_traceparent() -> str:
    """W3C ``traceparent`` of the active span, or "" when nothing is traced.

    Cheap when tracing is off (the default span is invalid), so hot paths may
    call it unconditionally.
    """
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_from_traceparent(traceparent: str) -> Context | None:
    """The OpenTelemetry context a ``traceparent`` names (None when empty or malformed)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def shutdown_tracing() -> None:
    """Flush and stop the tracer provider this module installed (no-op otherwise)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if _tracing_configured and callable(shutdown):
        shutdown()
