"""What an operator reads from a real ``kvmesh up`` fleet without Docker.

``--trace-file``: every service writes its spans to the file; one Clear
through the gateway is one trace id across the gateway and its storage node
(over the local lane, as ``up`` connects them), linked parent to child.
``kvmesh status --json``: snake_case keys throughout, and each node's
gateway address as the coordinator lists it (ListInstances).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.gateway.client import GatewayClient
from tests.support.harness import kvmesh_cli, spawn_cli

LINE = re.compile(r"^\s+(\S+)\s+grpc (\S+)\s+metrics http://(\S+)/metrics\s+pid (\d+)$")
# Clear is answered by the node's storage: one gateway span, one lane call, one storage span.
GATEWAY_CLEAR = "/kvmesh.gateway.v1.GatewayService/Clear"
STORAGE_CLEAR = "/kvmesh.storage.v1.StorageService/Clear"


def _start(
    trace_file: Path, nodes: int = 1
) -> tuple[subprocess.Popen[str], dict[str, str], list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVMESH_"))}
    proc = spawn_cli(
        "up", "--nodes", str(nodes), "--l1-size", "64MiB", "--chunk-size", "16",
        "--trace-file", str(trace_file),
        env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    grpc: dict[str, str] = {}
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        match = LINE.match(line.rstrip("\n"))
        if match:
            grpc[match.group(1)] = match.group(2)
        if "data and logs in" in line:
            break
    return proc, grpc, lines


def test_one_call_is_one_trace_across_gateway_and_storage_in_the_trace_file(
    tmp_path: Path,
) -> None:
    trace_file = tmp_path / "spans.jsonl"
    proc, grpc, lines = _start(trace_file)
    try:
        assert "node-0-gateway" in grpc, "".join(lines)
        assert any(f"spans in {trace_file}" in line for line in lines), "".join(lines)
        client = GatewayClient(grpc["node-0-gateway"])
        try:
            client.clear(gateway_pb2.ClearRequest(), timeout=30)
        finally:
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)  # every service flushes its spans as it stops
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-3000:]

    spans: list[dict[str, Any]] = [json.loads(line) for line in trace_file.read_text().splitlines()]
    served = [s for s in spans if s["name"] == GATEWAY_CLEAR and s["kind"] == "SERVER"]
    assert len(served) == 1, sorted({s["name"] for s in spans})
    trace_id = served[0]["trace_id"]
    trace = {s["span_id"]: s for s in spans if s["trace_id"] == trace_id}
    by_service = {(s["service"], s["name"], s["kind"]) for s in trace.values()}
    assert ("kvmesh-gateway", GATEWAY_CLEAR, "SERVER") in by_service
    assert ("kvmesh-gateway", STORAGE_CLEAR, "CLIENT") in by_service
    assert ("kvmesh-storage", STORAGE_CLEAR, "SERVER") in by_service
    # Parent links: storage's span ← the gateway's lane call ← the gateway's Lookup.
    storage = next(s for s in trace.values() if s["service"] == "kvmesh-storage")
    call = trace[storage["parent_id"]]
    assert (call["service"], call["name"], call["kind"]) == (
        "kvmesh-gateway",
        STORAGE_CLEAR,
        "CLIENT",
    )
    assert call["attributes"]["rpc.system"] == "kvmesh-lane"
    assert trace[call["parent_id"]]["name"] == GATEWAY_CLEAR
    # What an operator types to read it: the tree, parent above child.
    shown = kvmesh_cli("traces", str(trace_file), trace_id[:12], timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"trace {trace_id}: {len(trace)} spans")
    assert lines[1].startswith(f"  {GATEWAY_CLEAR}  SERVER  kvmesh-gateway")
    assert lines[2].startswith(f"    {STORAGE_CLEAR}  CLIENT  kvmesh-gateway")
    assert lines[3].startswith(f"      {STORAGE_CLEAR}  SERVER  kvmesh-storage")


def _keys(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield key
            yield from _keys(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _keys(inner)


def test_status_json_is_snake_case_and_lists_each_nodes_gateway(tmp_path: Path) -> None:
    proc, grpc, lines = _start(tmp_path / "spans.jsonl", nodes=2)
    try:
        assert {"coordinator", "node-0-gateway", "node-1-gateway"} <= set(grpc), "".join(lines)
        done = kvmesh_cli("status", "--coordinator", grpc["coordinator"], "--json", timeout=60)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)
    keys = set(_keys(status))
    assert "instance_id" in keys
    assert "heartbeat_age_seconds" in keys
    assert [k for k in keys if any(c.isupper() for c in k)] == []
    # One level per section, and 64-bit counters as JSON numbers.
    assert isinstance(status["instances"], list)
    assert isinstance(status["cursors"], list)
    assert isinstance(status["status"]["batches_admitted"], int)
    assert isinstance(status["stats"]["num_keys"], int)
    endpoints = {i["instance_id"]: i["endpoints"] for i in status["instances"]}
    assert endpoints["node-0"]["gateway_address"] == grpc["node-0-gateway"]
    assert endpoints["node-1"]["gateway_address"] == grpc["node-1-gateway"]
    assert endpoints["node-0"]["storage_address"] == grpc["node-0-storage"]
