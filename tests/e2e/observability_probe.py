"""Run a whole fleet with tracing on, do one store and one retrieve, print spans and metrics.

Run as a separate process by tests/e2e/test_observability.py: an OpenTelemetry
tracer provider is process-global, so installing the in-memory one here keeps
every other test untouched. The three services run as real gRPC servers on
loopback (in this process, so their spans land in one exporter); the engine
talks to the gateway with the typed client, as a connector does.

Prints one JSON object: the spans (name, trace id, span id, parent id) and the
three services' /metrics text before and after the traffic.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EXPORTER = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
trace.set_tracer_provider(_provider)

# Imported after the provider exists, so the servers and clients add tracing.
from kvmesh.api.coordinator.v1 import directory_pb2  # noqa: E402
from kvmesh.api.gateway.v1 import gateway_pb2  # noqa: E402
from kvmesh.coordinator.app import CoordinatorApp  # noqa: E402
from kvmesh.coordinator.client import DirectoryClient  # noqa: E402
from kvmesh.coordinator.config import CoordinatorConfig  # noqa: E402
from kvmesh.gateway.app import GatewayApp  # noqa: E402
from kvmesh.gateway.client import GatewayClient  # noqa: E402
from kvmesh.gateway.config import GatewayConfig  # noqa: E402
from kvmesh.storage.app import StorageApp  # noqa: E402
from kvmesh.storage.config import StorageConfig  # noqa: E402
from tests.integration.gateway.support import CHUNK, prange  # noqa: E402
from tests.integration.storage.support import MODEL, Engine  # noqa: E402
from tests.support.harness import server_thread  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

MIB = 1 << 20


def _metrics(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text: str = reply.read().decode()
        return text


def main() -> None:
    shm = Path("/dev/shm") / f"kvmesh-obs-{uuid.uuid4().hex[:10]}"
    (shm / "engine").mkdir(parents=True)
    (shm / "l1").mkdir()
    data = Path(tempfile.mkdtemp(prefix="kvmesh-obs-"))
    tracer = trace.get_tracer("engine")
    try:
        with server_thread() as thread:
            coordinator = thread.start(
                CoordinatorConfig(port=0, chunk_size=CHUNK, heartbeat_interval_seconds=0.5),
                CoordinatorApp,
            )
            storage = thread.start(
                StorageConfig(
                    port=0,
                    instance_id="obs-node",
                    coordinator_target=coordinator.target,
                    data_dir=str(data / "node"),
                    # Room for 128 chunks of 8 KiB: the stores below overflow it.
                    l1_size_bytes=1 * MIB,
                    l1_segment_bytes=1 * MIB,
                    shm_dir=str(shm / "l1"),
                    allowed_memory_dir=str(shm / "engine"),
                    l2=["disk"],
                    event_flush_ms=5,
                ),
                StorageApp,
            )
            gateway = thread.start(
                GatewayConfig(port=0, storage_target=storage.target, chunk_size=CHUNK), GatewayApp
            )
            servers = {"coordinator": coordinator, "storage": storage, "gateway": gateway}
            before = {n: _metrics(s.metrics.address) for n, s in servers.items() if s.metrics}
            engine = Engine(shm / "engine", "obs-engine")
            client = GatewayClient(gateway.target)
            directory = DirectoryClient(coordinator.target)
            client.register_kv_cache(engine.gateway_request())
            tokens = [int(t) for t in range(1000, 1000 + 2 * CHUNK)]
            blocks = list(range(2 * CHUNK // 16))
            EXPORTER.clear()
            with tracer.start_as_current_span("kvmesh.engine.store") as store_span:
                client.store(
                    gateway_pb2.StoreRequest(
                        engine_id=engine.engine_id,
                        range=prange("obs-r1", tokens, 0, 2 * CHUNK),
                        block_ids=blocks,
                    )
                )
            store_trace = f"{store_span.get_span_context().trace_id:032x}"

            def coordinator_knows(keys: int) -> bool:
                found = directory.lookup(
                    directory_pb2.LookupRequest(
                        tokens=directory_pb2.TokenQuery(
                            model_name=MODEL, world_size=1, token_ids=tokens
                        )
                    )
                )
                return found.cached_prefix_chunks == keys

            wait_until(lambda: coordinator_knows(2), timeout=30)

            client.lookup(
                gateway_pb2.LookupRequest(
                    request_id="obs-r2",
                    model_name=MODEL,
                    world_size=1,
                    token_ids=tokens,
                    wait_timeout_ms=5000,
                )
            )
            with tracer.start_as_current_span("kvmesh.engine.retrieve") as retrieve_span:
                client.retrieve(
                    gateway_pb2.RetrieveRequest(
                        engine_id=engine.engine_id,
                        range=prange("obs-r2", tokens, 0, 2 * CHUNK),
                        block_ids=[b + 8 for b in blocks],
                    )
                )
            retrieve_trace = f"{retrieve_span.get_span_context().trace_id:032x}"
            client.end_session(gateway_pb2.EndSessionRequest(request_id="obs-r2"))

            # More chunks than L1 holds: eviction must show in the metrics.
            span = 16 * CHUNK  # the engine's whole cache: 64 blocks of 16 tokens
            for i in range(10):
                more = [int(t) for t in range(100_000 + i * span, 100_000 + (i + 1) * span)]
                client.store(
                    gateway_pb2.StoreRequest(
                        engine_id=engine.engine_id,
                        range=prange(f"obs-more-{i}", more, 0, span),
                        block_ids=list(range(64)),
                    )
                )

            def spans_of(trace_id: str) -> list[str]:
                return [
                    s.name
                    for s in EXPORTER.get_finished_spans()
                    if f"{s.context.trace_id:032x}" == trace_id
                ]

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (
                "kvmesh.coordinator.IngestBatch" not in spans_of(store_trace)
                or "kvmesh.coordinator.IngestBatch" not in spans_of(retrieve_trace)
            ):
                time.sleep(0.05)
            # L2 writes run behind the stores: wait for the node to count one.
            storage_metrics = servers["storage"].metrics
            assert storage_metrics is not None
            while time.monotonic() < deadline and not re.search(
                r"^kvmesh_storage_l2_stored_keys_total(\{[^}]*\})? [1-9]",
                _metrics(storage_metrics.address),
                re.M,
            ):
                time.sleep(0.05)
            after = {n: _metrics(s.metrics.address) for n, s in servers.items() if s.metrics}
            spans = [
                {
                    "name": s.name,
                    "trace_id": f"{s.context.trace_id:032x}",
                    "span_id": f"{s.context.span_id:016x}",
                    "parent_id": f"{s.parent.span_id:016x}" if s.parent else "",
                }
                for s in EXPORTER.get_finished_spans()
            ]
            client.close()
            directory.close()
            engine_close: Any = getattr(engine, "close", None)
            if callable(engine_close):
                engine_close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
    json.dump(
        {
            "store_trace": store_trace,
            "retrieve_trace": retrieve_trace,
            "spans": spans,
            "metrics_before": before,
            "metrics_after": after,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
