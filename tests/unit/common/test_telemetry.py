"""Tracing settings from the standard OpenTelemetry variables, and the JSON-lines span format.

No global tracer provider is installed here: spans come from a private
``TracerProvider`` (a global one would trace every later test in the process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvmesh.common.config import ConfigError
from kvmesh.common.span_export import JsonLinesSpanExporter
from kvmesh.common.telemetry import (
    TRACING_HELP,
    TracingSettings,
    TracingSettingsError,
    configure_tracing,
    tracing_requested,
    tracing_settings,
)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, TracingSettings()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, TracingSettings(exporters=("otlp",))),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"},
            TracingSettings(exporters=("otlp",)),
        ),
        ({"OTEL_TRACES_EXPORTER": "console"}, TracingSettings(exporters=("console",))),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, TracingSettings(exporters=("otlp",))),
        (
            {"OTEL_TRACES_EXPORTER": " OTLP , console,otlp"},
            TracingSettings(exporters=("otlp", "console")),
        ),
        (
            {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
            TracingSettings(),
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            TracingSettings(exporters=("otlp",), protocol="http/protobuf"),
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            TracingSettings(exporters=("otlp",), protocol="http/protobuf"),
        ),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
            TracingSettings(sampler="parentbased_traceidratio", sampler_arg=0.25),
        ),
        (
            # The argument belongs to the ratio samplers only; others ignore it.
            {"OTEL_TRACES_SAMPLER": "always_off", "OTEL_TRACES_SAMPLER_ARG": "lots"},
            TracingSettings(sampler="always_off"),
        ),
        (
            {"KVMESH_TRACE_FILE": "/tmp/spans.jsonl", "OTEL_SERVICE_NAME": "edge-gw"},
            TracingSettings(trace_file="/tmp/spans.jsonl", service_name="edge-gw"),
        ),
        (
            {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"},
            TracingSettings(),
        ),
    ],
)
def test_settings_follow_the_standard_variables(
    environ: dict[str, str], expected: TracingSettings
) -> None:
    settings = tracing_settings(environ)
    assert settings == expected
    assert tracing_requested(environ) is expected.enabled


@pytest.mark.parametrize(
    ("environ", "variable", "valid"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER", "otlp, console, none"),
        ({"OTEL_TRACES_EXPORTER": "otlp,jaeger"}, "OTEL_TRACES_EXPORTER", "otlp, console, none"),
        ({"OTEL_TRACES_EXPORTER": "none,console"}, "OTEL_TRACES_EXPORTER", "cannot be combined"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "grpc, http/protobuf",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "grpc, http/protobuf",
        ),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER", "parentbased_always_on"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
            "OTEL_TRACES_SAMPLER_ARG",
            "a number from 0 to 1",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
            "OTEL_TRACES_SAMPLER_ARG",
            "a number from 0 to 1",
        ),
    ],
)
def test_an_unsupported_value_is_one_line_naming_the_variable_and_the_valid_ones(
    environ: dict[str, str], variable: str, valid: str
) -> None:
    with pytest.raises(TracingSettingsError) as raised:
        tracing_settings(environ)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{variable}=")
    assert valid in message
    assert tracing_requested(environ) is False
    # What a service's start-up sees: the configuration error its CLI prints as one line.
    with pytest.raises(ConfigError, match=variable):
        configure_tracing("gateway", environ)


def test_help_lists_every_variable_and_value() -> None:
    for word in (
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_SERVICE_NAME",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "KVMESH_TRACE_FILE",
        "http/protobuf",
        "console",
        "none",
        "/package.Service/Method",
    ):
        assert word in TRACING_HELP, word


def test_span_lines_carry_the_trace_and_the_parent(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    exporter = JsonLinesSpanExporter(path=str(path))
    provider = TracerProvider(resource=Resource.create({"service.name": "kvmesh-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with (
        tracer.start_as_current_span("outer") as outer,
        tracer.start_as_current_span(
            "/kvmesh.gateway.v1.GatewayService/Lookup",
            kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "tokens": [1, 2]},
        ) as inner,
    ):
        inner.add_event("hit", {"chunks": 3})
        inner.set_status(trace.StatusCode.ERROR, "storage unreachable")
    provider.shutdown()
    # A second writer (another process of the fleet) appends to the same file.
    second = JsonLinesSpanExporter(path=str(path))
    other = TracerProvider()
    other.add_span_processor(SimpleSpanProcessor(second))
    with other.get_tracer("test").start_as_current_span("other"):
        pass
    other.shutdown()

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_name = {line["name"]: line for line in lines}
    assert set(by_name) == {"outer", "/kvmesh.gateway.v1.GatewayService/Lookup", "other"}
    root = by_name["outer"]
    child = by_name["/kvmesh.gateway.v1.GatewayService/Lookup"]
    assert root["trace_id"] == f"{outer.get_span_context().trace_id:032x}"
    assert child["trace_id"] == root["trace_id"]
    assert child["parent_id"] == root["span_id"] == f"{outer.get_span_context().span_id:016x}"
    assert root["parent_id"] == ""
    assert child["kind"] == "SERVER"
    assert child["service"] == "kvmesh-test"
    assert child["status"] == "ERROR"
    assert child["status_message"] == "storage unreachable"
    assert child["attributes"] == {"rpc.system": "grpc", "tokens": [1, 2]}
    assert child["events"][0]["name"] == "hit"
    assert child["events"][0]["attributes"] == {"chunks": 3}
    assert child["duration_ms"] >= 0
    assert child["start"].endswith("Z")
    assert by_name["other"]["trace_id"] != root["trace_id"]
