"""Logging and OpenTelemetry tracing setup shared by every service.

Tracing is configured by the standard OpenTelemetry environment variables
(listed in :data:`TRACING_HELP`, which every service's ``--help`` shows):
``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``),
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc``, ``http/protobuf``),
``OTEL_SERVICE_NAME`` and ``OTEL_TRACES_SAMPLER``/``_ARG``, plus kvmesh's own
``KVMESH_TRACE_FILE`` (every span as one JSON line appended to a file that
all of a fleet's processes share; ``kvmesh up --trace-file``). A value that
is not supported is a one-line configuration error naming the variable and
what would be valid. With nothing set, no tracer provider is installed, the
tracing interceptors are not added, and the hot paths pay nothing for it.

Spans of remote calls are named ``/package.Service/Method`` on both
transports: the gRPC instrumentation names them so, and the local lane
(src/kvmesh/rpc/lane/) uses the same names (``rpc.system`` tells them apart:
``grpc`` or ``kvmesh-lane``).

Exporter failures (a collector that went away) are logged once, then at most
every few minutes (src/kvmesh/common/span_export.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


#: The variables tracing reads, as every service's ``--help`` lists them.
TRACING_HELP = """\
tracing (OpenTelemetry; read from the environment, passed on by kvmesh up):
  OTEL_TRACES_EXPORTER         otlp, console or none, comma-separated (default: otlp when
                               an OTLP endpoint is set, else none); console prints one JSON
                               line per span on stdout
  OTEL_EXPORTER_OTLP_ENDPOINT  the collector (default http://localhost:4317 for grpc,
                               http://localhost:4318 for http/protobuf)
  OTEL_EXPORTER_OTLP_PROTOCOL  grpc (default) or http/protobuf
  OTEL_SERVICE_NAME            service name on the spans (default: kvmesh-<service>)
  OTEL_TRACES_SAMPLER          parentbased_always_on (default), parentbased_always_off,
                               parentbased_traceidratio, always_on, always_off, traceidratio
  OTEL_TRACES_SAMPLER_ARG      the ratio of the *traceidratio samplers, in [0, 1] (default 1)
  KVMESH_TRACE_FILE            also append every span to this file as one JSON line
                               (kvmesh up --trace-file sets it for the whole fleet)
  The _TRACES_ forms (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, ..._PROTOCOL) override these.
  Spans of gRPC and local-lane calls are both named /package.Service/Method;
  grpc.health.v1 probes are not traced.
"""

EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = (
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
    "always_on",
    "always_off",
    "traceidratio",
)
TRACE_FILE_ENV = "KVMESH_TRACE_FILE"
#: How often a failing exporter is reported again (its first failure is logged at once).
EXPORT_FAILURE_REPORT_S = 300.0


class TracingSettingsError(ValueError):
    """A tracing variable holds an unsupported value (the message: variable, value, valid)."""


@dataclass(frozen=True)
class TracingSettings:
    """What the environment asks of tracing."""

    exporters: tuple[str, ...] = ()  # "otlp", "console"; empty: none
    protocol: str = "grpc"
    sampler: str = "parentbased_always_on"
    sampler_arg: float = 1.0
    service_name: str = ""
    trace_file: str = ""

    @property
    def enabled(self) -> bool:
        """True when spans go somewhere."""
        return bool(self.exporters or self.trace_file)


def _get(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip()


def _one_of(name: str, value: str, valid: tuple[str, ...]) -> str:
    if value.lower() not in valid:
        raise TracingSettingsError(f"{name}={value!r} is not supported (valid: {', '.join(valid)})")
    return value.lower()


def tracing_settings(environ: Mapping[str, str] | None = None) -> TracingSettings:
    """Read the tracing variables; raises TracingSettingsError for an unsupported value."""
    env = os.environ if environ is None else environ
    if _get(env, "OTEL_SDK_DISABLED").lower() == "true":
        return TracingSettings()
    endpoint = _get(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _get(
        env, "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    raw = _get(env, "OTEL_TRACES_EXPORTER")
    names = [n.strip() for n in raw.split(",") if n.strip()] if raw else []
    chosen = [_one_of("OTEL_TRACES_EXPORTER", n, EXPORTERS) for n in names]
    if "none" in chosen and len(chosen) > 1:
        raise TracingSettingsError(
            f"OTEL_TRACES_EXPORTER={raw!r}: none cannot be combined with other exporters"
        )
    if not raw:
        chosen = ["otlp"] if endpoint else []
    exporters = tuple(dict.fromkeys(n for n in chosen if n != "none"))
    protocol_var = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    protocol = _get(env, protocol_var)
    if not protocol:
        protocol_var = "OTEL_EXPORTER_OTLP_PROTOCOL"
        protocol = _get(env, protocol_var) or "grpc"
    protocol = _one_of(protocol_var, protocol, PROTOCOLS)
    sampler = _one_of(
        "OTEL_TRACES_SAMPLER", _get(env, "OTEL_TRACES_SAMPLER") or SAMPLERS[0], SAMPLERS
    )
    arg_text = _get(env, "OTEL_TRACES_SAMPLER_ARG")
    sampler_arg = 1.0
    if arg_text and sampler.endswith("traceidratio"):
        try:
            sampler_arg = float(arg_text)
        except ValueError:
            sampler_arg = -1.0
        if not 0.0 <= sampler_arg <= 1.0:
            raise TracingSettingsError(
                f"OTEL_TRACES_SAMPLER_ARG={arg_text!r} is not a ratio "
                f"(valid: a number from 0 to 1, for {sampler})"
            )
    return TracingSettings(
        exporters=exporters,
        protocol=protocol,
        sampler=sampler,
        sampler_arg=sampler_arg,
        service_name=_get(env, "OTEL_SERVICE_NAME"),
        trace_file=_get(env, TRACE_FILE_ENV),
    )


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment asks for spans (an unsupported value counts as no)."""
    try:
        return tracing_settings(environ).enabled
    except TracingSettingsError:
        return False


def tracing_enabled() -> bool:
    """True when spans go somewhere: the environment asks for them, or a provider is installed."""
    if tracing_requested():
        return True
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def configure_tracing(service: str, environ: Mapping[str, str] | None = None) -> bool:
    """Install a tracer provider exporting where the environment says.

    Returns whether tracing is enabled afterwards. Idempotent per process; a
    provider a caller (a test) installed first is kept. Raises
    :class:`~kvmesh.common.config.ConfigError` for an unsupported variable or
    a trace file that cannot be opened.
    """
    global _tracing_configured  # noqa: PLW0603 - process-wide, like the tracer provider itself
    with _tracing_lock:
        if _tracing_configured:
            return True
        from kvmesh.common.config import ConfigError

        try:
            settings = tracing_settings(environ)
        except TracingSettingsError as exc:
            raise ConfigError(str(exc)) from None
        installed = trace.get_tracer_provider()
        if not settings.enabled or not isinstance(
            installed, trace.ProxyTracerProvider | trace.NoOpTracerProvider
        ):
            return tracing_enabled()
        provider, targets = _build_provider(service, settings)
        trace.set_tracer_provider(provider)
        _tracing_configured = True
        logger.info(
            "tracing: spans of %s go to %s (sampler %s)",
            provider.resource.attributes.get("service.name", service),
            ", ".join(targets),
            settings.sampler
            + (f" {settings.sampler_arg}" if settings.sampler.endswith("ratio") else ""),
        )
        return True


def _build_provider(service: str, settings: TracingSettings) -> tuple[Any, list[str]]:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider, sampling
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    from kvmesh.common.config import ConfigError
    from kvmesh.common.span_export import JsonLinesSpanExporter, QuietExporter

    exporters: list[tuple[SpanExporter, str]] = []
    if "otlp" in settings.exporters:
        otlp: SpanExporter
        if settings.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            otlp = GrpcExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            otlp = HttpExporter()
        exporters.append((otlp, f"otlp/{settings.protocol} {getattr(otlp, '_endpoint', '?')}"))
    if "console" in settings.exporters:
        exporters.append((JsonLinesSpanExporter(stream=sys.stdout), "stdout"))
    if settings.trace_file:
        try:
            exporters.append((JsonLinesSpanExporter(path=settings.trace_file), settings.trace_file))
        except OSError as exc:
            raise ConfigError(
                f"{TRACE_FILE_ENV}={settings.trace_file!r}: cannot open it for appending "
                f"({exc.strerror or exc})"
            ) from None
    ratio = settings.sampler_arg
    sampler = {
        "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": sampling.ParentBasedTraceIdRatio(ratio),
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "traceidratio": sampling.TraceIdRatioBased(ratio),
    }[settings.sampler]
    detected = Resource.create()  # OTEL_SERVICE_NAME, then OTEL_RESOURCE_ATTRIBUTES
    name = settings.service_name or str(detected.attributes.get("service.name", ""))
    if not settings.service_name and name.startswith("unknown_service"):
        name = f"kvmesh-{service}"
    provider = TracerProvider(
        resource=detected.merge(Resource({"service.name": name})), sampler=sampler
    )
    for exporter, target in exporters:
        quiet = QuietExporter(exporter, target, report_every_s=EXPORT_FAILURE_REPORT_S)
        provider.add_span_processor(BatchSpanProcessor(quiet))
    return provider, [target for _, target in exporters]


#: The user agent of the calls a process makes on its own clock, not for a request
#: (the P2P membership poll): servers and clients make no span for them.
BACKGROUND_USER_AGENT = "kvmesh-background"


def untraced_calls() -> Any:
    """The gRPC instrumentation's filter for kvmesh's interceptors: every call but probes and polls.

    Orchestrators and the services themselves probe ``grpc.health.v1`` every
    few seconds, and nodes poll the coordinator's membership on a channel whose
    user agent starts with :data:`BACKGROUND_USER_AGENT`; a trace per probe or
    poll would bury the traces of real work.
    """
    from opentelemetry.instrumentation.grpc import filters

    def background(details: Any) -> bool:
        metadata = getattr(details, "invocation_metadata", None) or ()
        return any(
            key == "user-agent" and str(value).startswith(BACKGROUND_USER_AGENT)
            for key, value in metadata
        )

    return filters.negate(filters.any_of(filters.health_check(), background))


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
