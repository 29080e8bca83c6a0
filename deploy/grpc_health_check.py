#!/usr/bin/env python3
"""Probe a kvmesh service's ``grpc.health.v1`` endpoint: exit 0 on SERVING, 1 otherwise.

    kvmesh-health ADDRESS [SERVICE] [--timeout SECONDS]

The image installs it as ``kvmesh-health`` for docker-compose healthchecks
(grpcurl exits 0 on any answer, NOT_SERVING included). ``SERVICE`` is a
full service name such as ``kvmesh.gateway.v1.GatewayService``; empty asks
about the server as a whole. Anything but SERVING prints one line on stderr.
Needs only grpcio and grpcio-health-checking (kvmesh's own dependencies).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh-health", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the service's gRPC server")
    parser.add_argument("service", nargs="?", default="", help="service name ('' = the server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            code = exc.code().name if callable(getattr(exc, "code", None)) else "UNKNOWN"
            print(f"kvmesh-health: {args.address} {args.service or '(server)'}: {code}",
                  file=sys.stderr)  # fmt: skip
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"kvmesh-health: {args.address} {args.service or '(server)'}: {status}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
