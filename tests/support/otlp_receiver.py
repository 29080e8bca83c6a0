"""OTLP trace receivers for tests: a real gRPC server and a real HTTP server on loopback.

Both decode what the OpenTelemetry exporters send (``ExportTraceServiceRequest``)
and keep one :class:`ReceivedSpan` per span, so a test can check what a
service exported without Docker or a collector binary.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    kind: int


class Received:
    """Spans a receiver got, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.requests = 0

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.requests += 1
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append(
                            ReceivedSpan(service, span.name, span.trace_id.hex(), span.kind)
                        )

    def names(self) -> set[str]:
        with self._lock:
            return {s.name for s in self.spans}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(  # noqa: N802 - the OTLP method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def grpc_receiver(port: int = 0) -> Iterator[tuple[str, Received]]:
    """An OTLP/gRPC receiver; yields ``(host:port, received)``."""
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, f"cannot bind the OTLP receiver on 127.0.0.1:{port}"
    server.start()
    try:
        yield f"127.0.0.1:{bound}", received
    finally:
        server.stop(grace=None)


@contextmanager
def http_receiver(port: int = 0) -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP (protobuf) receiver; yields ``(http://host:port, received)``."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.add(request)
            payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
