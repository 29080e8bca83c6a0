"""Requests that do not parse: INVALID_ARGUMENT with a reason, on every method, on both transports.

Black-box, from the descriptors: every method of every service in
``kvmesh.api.*_pb2`` (a new RPC is covered without editing this file) gets
bytes of each malformed kind over gRPC — a raw ``unary_unary`` /
``stream_stream`` / … multi-callable without serializers, so the bytes
reach the server as they are — and over the local lane. Every one must be
answered INVALID_ARGUMENT with a ``google.rpc.ErrorInfo`` (reason
``MALFORMED_REQUEST``, domain ``kvmesh.dev``): never UNKNOWN or INTERNAL, and
never a traceback in the log. The lane serves unary methods only; a
streaming method there is UNIMPLEMENTED whatever the bytes.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import random
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError

import kvmesh.api
from kvmesh.api.coordinator.v1 import directory_pb2, ingest_pb2
from kvmesh.common.errors import ERROR_DOMAIN
from kvmesh.coordinator.app import CoordinatorApp
from kvmesh.coordinator.client import DirectoryClient
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.config import GatewayConfig
from kvmesh.rpc.errors import RpcError, error_info
from kvmesh.rpc.handlers import MALFORMED_REQUEST
from kvmesh.rpc.lane.client import LaneTransport
from kvmesh.rpc.server import Server
from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig
from tests.integration.coordinator.support import ADMITTED, batch, pkey, stores
from tests.support.harness import ServerThread, server_thread
from tests.support.ports import free_port

MIB = 1 << 20
TIMEOUT_S = 10.0

# -- the methods ---------------------------------------------------------------------------


def _services() -> list[Any]:
    found = []
    for info in pkgutil.walk_packages(kvmesh.api.__path__, "kvmesh.api."):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(info.name)
            found.extend(module.DESCRIPTOR.services_by_name.values())
    return sorted(found, key=lambda s: s.full_name)


SERVICES = _services()
METHODS = [method for service in SERVICES for method in service.methods]


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _server_of(method: MethodDescriptor) -> str:
    """Which test server serves the method's package (kvmesh.<area>.v1)."""
    return method.containing_service.full_name.split(".")[1]


# -- the malformed bytes -------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _string_field_path(message: Descriptor, depth: int = 0) -> list[int] | None:
    """Field numbers leading to a string field (through message fields), None when none."""
    for field in message.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            return [field.number]
    if depth < 4:
        for field in message.fields:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                inner = _string_field_path(field.message_type, depth + 1)
                if inner is not None:
                    return [field.number, *inner]
    return None


def _random_bytes(message: Descriptor) -> bytes:
    cls = message_factory.GetMessageClass(message)
    for seed in range(1000):
        data = random.Random(seed).randbytes(64)
        try:
            cls.FromString(data)
        except DecodeError:
            return data
    raise AssertionError(f"no random bytes fail to parse as {message.full_name}")


def _bad_utf8(message: Descriptor) -> bytes | None:
    path = _string_field_path(message)
    if path is None:
        return None
    data = b"\xc3\x28\xff\xfe"  # not UTF-8
    for number in reversed(path):
        data = _length_delimited(number, data)
    return data


KINDS: dict[str, Callable[[Descriptor], bytes | None]] = {
    "random-bytes": _random_bytes,
    "bad-varint": lambda _: b"\x08" + b"\xff" * 10 + b"\x01",  # 11 bytes: longer than any varint
    "truncated-length": lambda _: b"\x0a\x05ab",  # declares 5 bytes, carries 2
    "overflowing-length": lambda _: b"\x0a\xff\xff\xff\xff\x0f",  # declares 4 GiB
    "field-number-0": lambda _: b"\x00\x00",
    "wire-type-7": lambda _: b"\x0f\x00",
    "unterminated-group": lambda _: b"\x0b\x08\x01",
    "invalid-utf8-string": _bad_utf8,
    "nested-bomb": lambda _: b"\x0b" * 5000 + b"\x0c" * 5000,  # groups 5000 deep
}


def _parses(method: MethodDescriptor, data: bytes) -> bool:
    try:
        message_factory.GetMessageClass(method.input_type).FromString(data)
    except DecodeError:
        return False
    return True


def _cases(kind: str) -> list[tuple[MethodDescriptor, bytes]]:
    """(method, bytes) of one kind; methods whose request has no string skip the UTF-8 kind.

    The premise is checked: the bytes really do not parse. One exception is
    Protobuf's own: upb accepts a field number 0 in a message that declares
    no fields (``GetChunkSizeRequest``), so such a request parses on every
    transport and is left out of that kind.
    """
    cases = []
    for method in METHODS:
        data = KINDS[kind](method.input_type)
        if data is None:
            continue
        if _parses(method, data):
            assert kind == "field-number-0", f"{kind} parses as {method.input_type.full_name}"
            assert not method.input_type.fields, method.input_type.full_name
            continue
        cases.append((method, data))
    assert len(cases) >= len(METHODS) // 2, kind
    return cases


# -- the servers ---------------------------------------------------------------------------


@dataclass
class Servers:
    thread: ServerThread
    by_name: dict[str, Server]


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    """A gateway, a storage node and a coordinator, each serving gRPC and its lane."""
    root = Path("/dev/shm") / f"kvmesh-malformed-{uuid.uuid4().hex[:10]}"
    (root / "l1").mkdir(parents=True)
    (root / "engine").mkdir()
    sockets = Path("/tmp") / f"kvmesh-malformed-{uuid.uuid4().hex[:10]}"
    sockets.mkdir()
    try:
        with server_thread() as thread:
            common: dict[str, Any] = {"port": 0, "metrics_port": -1, "grace_seconds": 0.2}
            coordinator = thread.start(
                CoordinatorConfig(
                    **common,
                    lane_socket=str(sockets / "coordinator.sock"),
                    health_check_interval_seconds=0.0,
                    eviction_check_interval_seconds=0.0,
                    checkpoint_interval_seconds=0.0,
                ),
                CoordinatorApp,
            )
            storage = thread.start(
                StorageConfig(
                    **common,
                    lane_socket=str(sockets / "storage.sock"),
                    instance_id=f"malformed-{uuid.uuid4().hex[:8]}",
                    data_dir=str(root / "data"),
                    l1_size_bytes=32 * MIB,
                    l1_segment_bytes=16 * MIB,
                    shm_dir=str(root / "l1"),
                    allowed_memory_dir=str(root / "engine"),
                    l2=["none"],
                ),
                StorageApp,
            )
            gateway = thread.start(
                GatewayConfig(
                    **common,
                    lane_socket=str(sockets / "gateway.sock"),
                    storage_target=f"127.0.0.1:{free_port()}",
                ),
                GatewayApp,
            )
            yield Servers(
                thread, {"coordinator": coordinator, "storage": storage, "gateway": gateway}
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)


def test_every_service_has_a_server_here(servers: Servers) -> None:
    assert {_server_of(m) for m in METHODS} <= set(servers.by_name)
    assert any(m.client_streaming and m.server_streaming for m in METHODS)


# -- the checks ----------------------------------------------------------------------------


def _problem(
    error: grpc.RpcError | None, expected: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
) -> str | None:
    """What is wrong with how a malformed request was answered (None: nothing)."""
    if error is None:
        return "succeeded"
    failed: Any = error
    if failed.code() != expected:
        return f"{failed.code().name}: {failed.details()}"
    if expected != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    info = error_info(error)
    if info is None:
        return f"INVALID_ARGUMENT without ErrorInfo: {failed.details()}"
    if (info.reason, info.domain) != (MALFORMED_REQUEST, ERROR_DOMAIN):
        return f"ErrorInfo {info.reason}/{info.domain}"
    return None


def _over_grpc(
    channel: grpc.Channel, method: MethodDescriptor, data: bytes
) -> grpc.RpcError | None:
    path = _path(method)
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path)(iter([data]), timeout=TIMEOUT_S):
                pass
        elif method.client_streaming:
            channel.stream_unary(path)(iter([data]), timeout=TIMEOUT_S)
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(data, timeout=TIMEOUT_S):
                pass
        else:
            channel.unary_unary(path)(data, timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc
    return None


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [f"{r.name}: {r.getMessage()}" for r in bad]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_over_grpc_every_method_answers_invalid_argument(
    servers: Servers, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    channels = {name: grpc.insecure_channel(s.target) for name, s in servers.by_name.items()}
    try:
        problems = {}
        for method, data in _cases(kind):
            problem = _problem(_over_grpc(channels[_server_of(method)], method, data))
            if problem is not None:
                problems[_path(method)] = problem
    finally:
        for channel in channels.values():
            channel.close()
    assert problems == {}
    _no_tracebacks(caplog)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_over_the_lane_every_method_answers_invalid_argument(
    servers: Servers, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    lanes = {}
    for name, server in servers.by_name.items():
        assert server.lane is not None
        lanes[name] = LaneTransport(str(server.lane.path))
    try:
        problems = {}
        for method, data in _cases(kind):
            streaming = method.client_streaming or method.server_streaming
            expected = (
                grpc.StatusCode.UNIMPLEMENTED if streaming else grpc.StatusCode.INVALID_ARGUMENT
            )
            error: RpcError | None = None
            try:
                lanes[_server_of(method)].call(_path(method), data, TIMEOUT_S)
            except RpcError as exc:
                error = exc
            problem = _problem(error, expected)
            if problem is not None:
                problems[_path(method)] = problem
    finally:
        for lane in lanes.values():
            lane.close()
    assert problems == {}
    _no_tracebacks(caplog)


def test_a_stream_ends_at_its_bad_message_and_keeps_what_came_before(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    coordinator = servers.by_name["coordinator"]
    instance = f"node-{uuid.uuid4().hex[:8]}"
    good = [
        ingest_pb2.StreamEventsRequest(
            open=ingest_pb2.StreamOpen(instance_id=instance, incarnation=1)
        ),
        ingest_pb2.StreamEventsRequest(batch=batch(instance, 1, entries=stores([7001, 7002]))),
    ]
    requests = [m.SerializeToString() for m in good] + [b"\x0a\xff\xff\xff\xff\x0f"]
    responses: list[ingest_pb2.StreamEventsResponse] = []
    path = "/kvmesh.coordinator.v1.EventIngestService/StreamEvents"
    error: grpc.RpcError | None = None
    with grpc.insecure_channel(coordinator.target) as channel:
        try:
            for body in channel.stream_stream(path)(iter(requests), timeout=TIMEOUT_S):
                responses.append(ingest_pb2.StreamEventsResponse.FromString(body))
        except grpc.RpcError as exc:
            error = exc
    assert _problem(error) is None
    acks = [r.ack for r in responses if r.WhichOneof("kind") == "ack"]
    assert [(a.seq, a.result) for a in acks] == [(1, ADMITTED)]  # the batch before the bad one
    directory = DirectoryClient(coordinator.target)
    try:
        found = directory.lookup(
            directory_pb2.LookupRequest(keys=directory_pb2.KeyList(keys=[pkey(7001), pkey(7002)]))
        )
    finally:
        directory.close()
    assert [[p.instance_id for p in r.placements] for r in found.results] == [[instance]] * 2
    _no_tracebacks(caplog)
