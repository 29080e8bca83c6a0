"""Tracing and process metrics as an operator configures and reads them.

Real exporters against real OTLP receivers (gRPC and HTTP, tests/support/otlp_receiver.py),
real service processes configured only by the standard OTEL_* variables, and
the spans of one call over gRPC and over the local lane. A tracer provider
is process-wide, so everything that installs one runs in its own process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvmesh.api.coordinator.v1 import membership_pb2
from kvmesh.common.span_export import QuietExporter
from kvmesh.coordinator.client import MembershipClient
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.config import GatewayConfig
from tests.support.harness import REPO_ROOT, kvmesh_cli, server_thread, spawn_cli
from tests.support.otlp_receiver import Received, grpc_receiver, http_receiver
from tests.support.ports import free_port
from tests.support.waiting import wait_until

LIST_INSTANCES = "/kvmesh.coordinator.v1.MembershipService/ListInstances"


def _spans(n: int) -> list[ReadableSpan]:
    tracer = TracerProvider().get_tracer("test")  # private: no global provider
    out = []
    for i in range(n):
        span = tracer.start_span(f"span-{i}")
        span.end()
        out.append(span)
    return out


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_exporter_failures_are_logged_once_then_rate_limited(
    protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # nothing listens: the collector is gone
    now = [0.0]
    inner: SpanExporter
    if protocol == "grpc":
        inner = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=1)
        receiver, cause = grpc_receiver, "UNAVAILABLE"
    else:
        inner = HttpSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=1)
        receiver, cause = http_receiver, "Failed to export spans batch"
    quiet = QuietExporter(
        inner, f"otlp/{protocol} 127.0.0.1:{port}", report_every_s=300, clock=lambda: now[0]
    )
    caplog.set_level(logging.DEBUG)
    try:
        for step in range(4):
            now[0] = step * 10.0
            assert quiet.export(_spans(2)) is SpanExportResult.FAILURE
        ours = [r for r in caplog.records if r.name == "kvmesh.common.span_export"]
        assert [r.levelname for r in ours] == ["WARNING"]
        assert f"127.0.0.1:{port}" in ours[0].getMessage()
        assert cause in ours[0].getMessage()  # the exporter's cause, folded in
        # The exporter's own per-batch warnings and errors are not on the log.
        loud = [
            r
            for r in caplog.records
            if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING
        ]
        assert loud == []

        now[0] = 400.0  # past the report interval: one summary line
        assert quiet.export(_spans(1)) is SpanExportResult.FAILURE
        ours = [r for r in caplog.records if r.name == "kvmesh.common.span_export"]
        assert len(ours) == 2
        assert "5 batches (9 spans) dropped" in ours[1].getMessage()

        # The collector comes back on the same port: one INFO line, and quiet again.
        with receiver(port) as (_, received):
            wait_until(
                lambda: quiet.export(_spans(1)) is SpanExportResult.SUCCESS,
                timeout=60,
                interval=0.2,
            )
            assert received.requests >= 1
        ours = [r for r in caplog.records if r.name == "kvmesh.common.span_export"]
        assert ours[-1].levelname == "INFO"
        assert "again" in ours[-1].getMessage()
        assert not quiet.failing
    finally:
        quiet.shutdown()


def test_the_metrics_endpoint_serves_process_series_and_logs_its_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvmesh.rpc.metrics")
    with server_thread() as thread:
        server = thread.start(
            GatewayConfig(port=0, storage_target=f"127.0.0.1:{free_port()}"), GatewayApp
        )
        assert server.metrics is not None
        url = f"http://{server.metrics.address}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    for series in (
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ):
        assert f"\n{series} " in text, series
    lines = [r.getMessage() for r in caplog.records if r.name == "kvmesh.rpc.metrics"]
    assert f"metrics on {url}" in lines


# -- one naming scheme on both transports -------------------------------------------------

_BOTH_TRANSPORTS = """
import json, tempfile, os
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.gateway.config import GatewayConfig
from tests.support.harness import server_thread
out = {}
with tempfile.TemporaryDirectory() as tmp, server_thread() as thread:
    config = GatewayConfig(
        port=0, storage_target="127.0.0.1:1", lane_socket=os.path.join(tmp, "gw.lane")
    )
    server = thread.start(config, GatewayApp)
    for transport, target in (("grpc", server.target), ("lane", server.lane.target)):
        exporter.clear()
        client = GatewayClient(target)
        client.get_chunk_size(gateway_pb2.GetChunkSizeRequest())
        client.close()
        out[transport] = sorted(
            (s.name, s.kind.name, s.attributes.get("rpc.system"), s.attributes.get("rpc.service"),
             s.attributes.get("rpc.method"))
            for s in exporter.get_finished_spans()
        )
    # Health probes (every few seconds from orchestrators) make no spans, on either side.
    import asyncio
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from kvmesh.rpc.transport import create_aio_channel, create_channel
    exporter.clear()
    channel = create_channel(server.target)
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    channel.close()

    async def probe():
        async with create_aio_channel(server.target) as aio:
            await health_pb2_grpc.HealthStub(aio).Check(health_pb2.HealthCheckRequest(), timeout=10)

    asyncio.run(probe())
    out["health"] = sorted(s.name for s in exporter.get_finished_spans())
    # Nor do calls on a background channel (polls made on the process's own clock).
    exporter.clear()
    channel = create_channel(server.target, background=True)
    GatewayClient(server.target, channel=channel).get_chunk_size(gateway_pb2.GetChunkSizeRequest())
    channel.close()
    out["background"] = sorted(s.name for s in exporter.get_finished_spans())
print(json.dumps(out))
"""


def test_grpc_and_lane_calls_give_spans_of_the_same_names_and_probes_none() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _BOTH_TRANSPORTS],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spans = json.loads(done.stdout)
    method = "/kvmesh.gateway.v1.GatewayService/GetChunkSize"
    assert spans["health"] == []
    assert spans["background"] == []
    for transport, system in (("grpc", "grpc"), ("lane", "kvmesh-lane")):
        assert sorted(tuple(s) for s in spans[transport]) == [
            (method, "CLIENT", system, "kvmesh.gateway.v1.GatewayService", "GetChunkSize"),
            (method, "SERVER", system, "kvmesh.gateway.v1.GatewayService", "GetChunkSize"),
        ], transport


# -- a service configured by the standard variables only ----------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVMESH_"))}
    env.update(extra)
    return env


@pytest.fixture
def coordinator_with() -> Iterator[object]:
    started: list[subprocess.Popen[str]] = []

    def start(tmp: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
        ready = tmp / "coordinator.ready.json"
        proc = spawn_cli(
            "coordinator", "--port", "0", "--metrics-port", "0", "--ready-file", str(ready),
            env=env,
        )  # fmt: skip
        started.append(proc)
        wait_until(
            lambda: ready.exists() or proc.poll() is not None, timeout=60, message="no ready file"
        )
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        address = str(json.loads(ready.read_text())["grpc"])
        return proc, address

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _call_and_stop(proc: subprocess.Popen[str], address: str) -> tuple[str, str]:
    client = MembershipClient(address)
    try:
        client.list_instances(membership_pb2.ListInstancesRequest(), timeout=10)
    finally:
        client.close()
    proc.send_signal(signal.SIGTERM)  # a clean stop flushes the batch of spans
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return out, err


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_export_follows_the_protocol_and_the_service_name(
    protocol: str, tmp_path: Path, coordinator_with: object
) -> None:
    receiver = grpc_receiver() if protocol == "grpc" else http_receiver()
    with receiver as (endpoint, received):
        received_: Received = received
        env = _clean_env(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint if protocol != "grpc" else f"http://{endpoint}",
            OTEL_SERVICE_NAME="fleet-a-coordinator",
        )
        proc, address = coordinator_with(tmp_path, env)  # type: ignore[operator]
        _, err = _call_and_stop(proc, address)
        wait_until(lambda: LIST_INSTANCES in received_.names(), timeout=30)
        services = {s.service for s in received_.spans if s.name == LIST_INSTANCES}
        assert services == {"fleet-a-coordinator"}
        assert f"otlp/{protocol}" in err  # the one INFO line saying where spans go


def test_console_exporter_prints_one_json_line_per_span(
    tmp_path: Path, coordinator_with: object
) -> None:
    env = _clean_env(OTEL_TRACES_EXPORTER="console")
    proc, address = coordinator_with(tmp_path, env)  # type: ignore[operator]
    out, _ = _call_and_stop(proc, address)
    spans = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    served = [s for s in spans if s["name"] == LIST_INSTANCES]
    assert served, out[-2000:]
    assert served[0]["kind"] == "SERVER"
    assert served[0]["service"] == "kvmesh-coordinator"
    assert len(served[0]["trace_id"]) == 32


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (
            ["coordinator", "--port", "0"],
            {"OTEL_TRACES_EXPORTER": "zipkin"},
            "OTEL_TRACES_EXPORTER",
        ),
        (
            ["gateway", "--port", "0"],
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            ["coordinator", "--port", "0"],
            {"KVMESH_TRACE_FILE": "/nonexistent-dir/spans.jsonl"},
            "KVMESH_TRACE_FILE",
        ),
        (["up"], {"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        (["up", "--trace-file", "/nonexistent-dir/spans.jsonl"], {}, "--trace-file"),
    ],
)
def test_bad_tracing_settings_are_one_line_and_exit_2(
    args: list[str], env: dict[str, str], named: str
) -> None:
    done = kvmesh_cli(*args, env=_clean_env(**env), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert named in lines[0]
    assert "Traceback" not in done.stderr
