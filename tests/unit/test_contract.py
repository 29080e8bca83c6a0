"""The contract: committed stubs match the .proto files; every RPC is served and wrapped.

Modelled on Temporal's Python SDK: generated code is committed and checked
for drift, and a test walks every RPC of every service to make sure the
servicer implements it and the typed client has a method for it whose
default deadline is the one the .proto comment documents.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor

from tests.support.harness import REPO_ROOT

GEN = REPO_ROOT / "scripts" / "gen_protos.py"

# service name -> (proto file, _pb2 module, servicer "module:Class", client "module:Class")
SERVICES = {
    "kvmesh.gateway.v1.GatewayService": (
        "kvmesh/gateway/v1/gateway.proto",
        "kvmesh.api.gateway.v1.gateway_pb2",
        "kvmesh.gateway.servicer:GatewayServicer",
        "kvmesh.gateway.client:GatewayClient",
    ),
    "kvmesh.storage.v1.StorageService": (
        "kvmesh/storage/v1/storage.proto",
        "kvmesh.api.storage.v1.storage_pb2",
        "kvmesh.storage.servicer:StorageServicer",
        "kvmesh.storage.client:StorageClient",
    ),
    "kvmesh.storage.v1.PeerService": (
        "kvmesh/storage/v1/peer.proto",
        "kvmesh.api.storage.v1.peer_pb2",
        "kvmesh.storage.peers.servicer:PeerServicer",
        "kvmesh.storage.peer_client:PeerClient",
    ),
    "kvmesh.coordinator.v1.EventIngestService": (
        "kvmesh/coordinator/v1/ingest.proto",
        "kvmesh.api.coordinator.v1.ingest_pb2",
        "kvmesh.coordinator.servicers.ingest:EventIngestServicer",
        "kvmesh.coordinator.client:EventIngestClient",
    ),
    "kvmesh.coordinator.v1.DirectoryService": (
        "kvmesh/coordinator/v1/directory.proto",
        "kvmesh.api.coordinator.v1.directory_pb2",
        "kvmesh.coordinator.servicers.directory:DirectoryServicer",
        "kvmesh.coordinator.client:DirectoryClient",
    ),
    "kvmesh.coordinator.v1.MembershipService": (
        "kvmesh/coordinator/v1/membership.proto",
        "kvmesh.api.coordinator.v1.membership_pb2",
        "kvmesh.coordinator.servicers.membership:MembershipServicer",
        "kvmesh.coordinator.client:MembershipClient",
    ),
    "kvmesh.coordinator.v1.PolicyService": (
        "kvmesh/coordinator/v1/policy.proto",
        "kvmesh.api.coordinator.v1.policy_pb2",
        "kvmesh.coordinator.servicers.policy:PolicyServicer",
        "kvmesh.coordinator.operator_client:PolicyClient",
    ),
    "kvmesh.coordinator.v1.EngineService": (
        "kvmesh/coordinator/v1/engines.proto",
        "kvmesh.api.coordinator.v1.engines_pb2",
        "kvmesh.coordinator.servicers.engines:EngineServicer",
        "kvmesh.coordinator.engine_client:EngineClient",
    ),
    "kvmesh.coordinator.v1.AdminService": (
        "kvmesh/coordinator/v1/admin.proto",
        "kvmesh.api.coordinator.v1.admin_pb2",
        "kvmesh.coordinator.servicers.admin:AdminServicer",
        "kvmesh.coordinator.operator_client:AdminClient",
    ),
}


def _load(ref: str) -> type:
    module, _, name = ref.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def _methods(full_name: str) -> list[descriptor.MethodDescriptor]:
    _, module, _, _ = SERVICES[full_name]
    pb2 = importlib.import_module(module)
    return list(pb2.DESCRIPTOR.services_by_name[full_name.rsplit(".", 1)[1]].methods)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower().replace("k_v_", "kv_")


def _documented_deadlines(proto: str) -> dict[str, str]:
    text = (REPO_ROOT / "protos" / proto).read_text()
    found = {}
    for comment, rpc in re.findall(r"((?:[ \t]*//[^\n]*\n)+)[ \t]*rpc (\w+)\(", text):
        flat = " ".join(line.strip().lstrip("/").strip() for line in comment.splitlines())
        match = re.search(r"Deadline: ([^.]+)\.", flat)
        assert match, f"rpc {rpc} in {proto} has no 'Deadline:' in its comment"
        found[rpc] = match.group(1)
    return found


def test_committed_stubs_match_the_protos() -> None:
    result = subprocess.run(
        [sys.executable, str(GEN), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_editing_a_proto_without_regenerating_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "protos", copy / "protos")
    shutil.copytree(REPO_ROOT / "src" / "kvmesh" / "api", copy / "src" / "kvmesh" / "api")
    proto = copy / "protos" / "kvmesh" / "gateway" / "v1" / "gateway.proto"
    proto.write_text(
        proto.read_text().replace("message PingRequest {", "message PingRequest {\n  bool x = 9;")
    )
    result = subprocess.run(
        [sys.executable, str(GEN), "--check", "--root", str(copy)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "differs: gateway/v1/gateway_pb2.py" in result.stdout
    # And regenerating the copy makes it pass again.
    subprocess.run([sys.executable, str(GEN), "--root", str(copy)], check=True, capture_output=True)
    again = subprocess.run(
        [sys.executable, str(GEN), "--check", "--root", str(copy)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert again.returncode == 0, again.stdout


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_rpc_has_a_servicer_method(service: str) -> None:
    servicer = _load(SERVICES[service][2])
    for method in _methods(service):
        impl = getattr(servicer, method.name, None)
        assert impl is not None, f"{servicer.__name__} lacks {method.name}"
        # Implemented here, not inherited from the generated base (which answers UNIMPLEMENTED).
        assert method.name in vars(servicer), (
            f"{servicer.__name__}.{method.name} is not implemented"
        )


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_rpc_has_a_typed_client_method_with_the_documented_deadline(service: str) -> None:
    proto = SERVICES[service][0]
    client = _load(SERVICES[service][3])
    deadlines = _documented_deadlines(proto)
    for method in _methods(service):
        wrapper = getattr(client, _snake(method.name), None)
        assert callable(wrapper), f"{client.__name__} lacks {_snake(method.name)}()"
        hints = wrapper.__annotations__
        assert "return" in hints, f"{client.__name__}.{_snake(method.name)} is not typed"
        documented = deadlines[method.name]
        if method.client_streaming or method.server_streaming:
            assert documented.startswith("none"), documented
            continue
        policy = client.POLICIES[method.name]
        seconds = float(re.search(r"(\d+(?:\.\d+)?) s", documented).group(1))  # type: ignore[union-attr]
        assert policy.timeout == seconds, (
            f"{method.name}: client default {policy.timeout} s, .proto says {documented}"
        )


def test_no_rpc_carries_opaque_encoded_bytes() -> None:
    allowed = {
        # Digests and fixed-size CUDA handles, all documented as such.
        "chunk_hash",
        "chunk_hashes",
        "memory_handle",
        "ref_counter_handle",
        "event_handle",
        "producer_event_handle",
        "completion_event_handle",
        # Raw KV bytes of one P2P frame (ChunkFrame.data), not an encoding.
        "data",
    }
    for _, module, _, _ in SERVICES.values():
        pb2 = importlib.import_module(module)
        for message in pb2.DESCRIPTOR.message_types_by_name.values():
            for field in message.fields:
                if field.type == descriptor.FieldDescriptor.TYPE_BYTES:
                    assert field.name in allowed, f"{message.full_name}.{field.name} is bytes"
