"""One store and one retrieve are each one trace across gateway → storage → coordinator,
and every service's kvmesh_* metrics move with the traffic.

The probe runs in its own process (tests/e2e/observability_probe.py) because
an OpenTelemetry tracer provider is process-global; it captures spans with
the SDK's in-memory exporter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest

from tests.support.harness import REPO_ROOT

INGEST = "kvmesh.coordinator.IngestBatch"


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.e2e.observability_probe"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _trace(probe: dict[str, Any], trace_id: str) -> list[str]:
    return [s["name"] for s in probe["spans"] if s["trace_id"] == trace_id]


def test_one_store_is_one_trace_from_gateway_to_coordinator(probe: dict[str, Any]) -> None:
    names = _trace(probe, probe["store_trace"])
    assert "kvmesh.engine.store" in names
    assert "/kvmesh.gateway.v1.GatewayService/Store" in names
    assert "/kvmesh.storage.v1.StorageService/StoreChunks" in names
    assert INGEST in names


def test_one_retrieve_is_one_trace_from_gateway_to_coordinator(probe: dict[str, Any]) -> None:
    names = _trace(probe, probe["retrieve_trace"])
    assert "/kvmesh.gateway.v1.GatewayService/Retrieve" in names
    assert "/kvmesh.storage.v1.StorageService/RetrieveChunks" in names
    assert INGEST in names


def test_the_coordinator_span_is_a_child_within_the_store_trace(probe: dict[str, Any]) -> None:
    spans = {s["span_id"]: s for s in probe["spans"] if s["trace_id"] == probe["store_trace"]}
    ingest = next(s for s in spans.values() if s["name"] == INGEST)
    # Walk up: the ingest's ancestors reach the storage handler and the engine's root span.
    chain = []
    node = ingest
    while node["parent_id"] in spans:
        node = spans[node["parent_id"]]
        chain.append(node["name"])
    assert "/kvmesh.storage.v1.StorageService/StoreChunks" in chain
    assert chain[-1] == "kvmesh.engine.store"


def _value(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name`` whose label set contains ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+\d.eE]+|NaN)$", line)
        if match and match.group(1) == name and labels in (match.group(2) or ""):
            total += float(match.group(3))
    return total


@pytest.mark.parametrize(
    ("service", "metric", "labels"),
    [
        ("gateway", "kvmesh_gateway_lookups_total", ""),
        ("gateway", "kvmesh_gateway_lookup_hit_tokens_total", ""),
        ("gateway", "kvmesh_gateway_stored_chunks_total", ""),
        ("gateway", "kvmesh_gateway_retrieved_chunks_total", ""),
        ("gateway", "kvmesh_rpc_requests_total", 'method="Lookup"'),
        ("storage", "kvmesh_storage_l1_used_bytes", ""),
        ("storage", "kvmesh_storage_l1_evicted_keys_total", ""),
        ("storage", "kvmesh_storage_l2_stored_keys_total", ""),
        ("storage", "kvmesh_storage_emitter_batches_acked_total", ""),
        ("storage", "kvmesh_rpc_requests_total", 'method="StoreChunks"'),
        ("coordinator", "kvmesh_coordinator_ingest_batches_total", 'result="admitted"'),
        ("coordinator", "kvmesh_coordinator_placements", 'tier="l1"'),
        ("coordinator", "kvmesh_coordinator_keys", ""),
    ],
)
def test_metrics_move_with_traffic(
    probe: dict[str, Any], service: str, metric: str, labels: str
) -> None:
    before = _value(probe["metrics_before"][service], metric, labels)
    after = _value(probe["metrics_after"][service], metric, labels)
    assert after > before, f"{service} {metric}{{{labels}}}: {before} -> {after}"
