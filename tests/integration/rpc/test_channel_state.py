"""A new client channel never inherits another channel's failed connection.

gRPC shares connections between channels to the same address (a process-wide
subchannel pool); a channel still open to a server that died kept that
address's connection in back-off, and a new client to a new server on the same
address failed at once with the dead server's "Connection refused".
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc

from kvmesh.rpc.transport import create_channel
from tests.support.ports import free_port


def _call(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        channel.unary_unary("/kvmesh.test.v1.Nobody/Call")(b"", timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_new_channel_reaches_a_server_that_an_old_channel_saw_refused() -> None:
    target = f"127.0.0.1:{free_port()}"
    old = create_channel(target)  # left open, as a client of a dead server may be
    server = None
    try:
        for _ in range(5):  # nothing listens yet: the old channel's connection backs off
            assert _call(old) is grpc.StatusCode.UNAVAILABLE
            time.sleep(0.3)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_insecure_port(target)
        server.start()
        new = create_channel(target)
        try:
            # UNIMPLEMENTED: the call reached the new server (it serves no such method).
            assert _call(new) is grpc.StatusCode.UNIMPLEMENTED
        finally:
            new.close()
    finally:
        old.close()
        if server is not None:
            server.stop(0)
