"""The real-server fixtures of tests/support/servers.py: start, answer, restart on their port."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

from tests.support.servers import ServerProcess


def read_line(host: str, port: int, send: bytes = b"") -> bytes:
    with socket.create_connection((host, port), timeout=5) as sock:
        if send:
            sock.sendall(send)
        data = b""
        while not data.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            assert chunk, "server closed the connection"
            data += chunk
        return data


def test_redis_fixture_answers_ping_and_restarts_on_the_same_port(
    redis_server_factory: Callable[[], ServerProcess],
) -> None:
    server = redis_server_factory()
    assert server.url == f"redis://127.0.0.1:{server.port}"
    assert read_line(*server.address, send=b"PING\r\n") == b"+PONG\r\n"
    port, pid = server.port, server.pid
    server.kill()
    assert not server.running
    server.start()
    assert (server.port, server.running) == (port, True)
    assert server.pid != pid
    assert read_line(*server.address, send=b"PING\r\n") == b"+PONG\r\n"


def test_nats_fixture_runs_jetstream(nats_server: ServerProcess) -> None:
    assert nats_server.url.startswith("nats://127.0.0.1:")
    line = read_line(*nats_server.address)
    assert line.startswith(b"INFO ")
    assert json.loads(line[5:])["jetstream"] is True


def test_s3_fixture_serves_an_endpoint(s3_server: ServerProcess) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_server.url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    try:
        client.create_bucket(Bucket="fixture-check")
        names = [b["Name"] for b in client.list_buckets()["Buckets"]]
        assert "fixture-check" in names
    finally:
        client.close()
