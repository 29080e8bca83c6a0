"""Ingest a batch inside the trace of the request that produced it.

A batch carries the W3C traceparent of the request that made its first
change (see ``kvmesh.events.v1.CacheEventBatch.traceparent``); ingesting it
in a span of that trace makes one store one trace from the gateway to the
coordinator, whichever transport (gRPC stream or NATS) carried the batch.
Both transports call :func:`ingest_traced`, so it lives in the core they
share rather than in either of them.
"""

from __future__ import annotations

from opentelemetry import trace

from kvmesh.common.events import CacheEventBatch, IngestResult
from kvmesh.common.telemetry import context_from_traceparent

from .coordinator import Coordinator

_tracer = trace.get_tracer("kvmesh.coordinator")


def ingest_traced(core: Coordinator, batch: CacheEventBatch, transport: str) -> IngestResult:
    """``core.ingest_validated(batch)``, in the batch's trace when it carries one."""
    parent = context_from_traceparent(batch.traceparent) if batch.traceparent else None
    if parent is None:
        return core.ingest_validated(batch)
    with _tracer.start_as_current_span(
        "kvmesh.coordinator.IngestBatch",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes={
            "kvmesh.instance_id": batch.instance_id,
            "kvmesh.seq": batch.seq,
            "kvmesh.event_type": batch.event_type.name,
            "kvmesh.entries": len(batch.entries),
            "kvmesh.transport": transport,
        },
    ) as span:
        result = core.ingest_validated(batch)
        span.set_attribute("kvmesh.ingest_result", result.name)
        return result
