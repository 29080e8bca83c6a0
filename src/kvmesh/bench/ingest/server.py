"""The coordinator under test: a ``kvmesh coordinator`` subprocess on a free loopback port.

It dies with this process (``PR_SET_PDEATHSIG``) and is stopped on the way
out; :func:`rss_bytes` reads its memory (:func:`kvmesh.bench.common.cpu_seconds` its CPU time)
from ``/proc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.bench.common import free_port

from .params import START_TIMEOUT_S

INGEST_SERVICE = "kvmesh.coordinator.v1.EventIngestService"


try:
    # Loaded up front: the preexec hook runs between fork and exec, no place to load a library.
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux: children are still stopped in ``finally``
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel SIGKILLs the
    # coordinator if this process dies, so a killed bench leaves nothing behind.
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class CoordinatorProcess:
    """A ``kvmesh coordinator`` subprocess."""

    proc: subprocess.Popen[bytes]
    target: str
    log_path: Path

    def log_tail(self, limit: int = 3000) -> str:
        """The end of its log, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""


@contextlib.contextmanager
def coordinator_process(workdir: Path, extra: Sequence[str] = ()) -> Iterator[CoordinatorProcess]:
    """Start ``kvmesh coordinator`` on a free port; SIGTERM (then SIGKILL) it on exit."""
    port = free_port()
    log_path = workdir / "coordinator.log"
    args = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "coordinator",
        "--port",
        str(port),
        "--metrics-port",
        "-1",
        "--log-level",
        "WARNING",
        "--health-check-interval-seconds",
        "0",
        "--eviction-check-interval-seconds",
        "0",
        *extra,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Safe here: no gRPC channel exists in this process yet (a fork while
            # gRPC threads run would run gRPC's fork handlers in the child).
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
    handle = CoordinatorProcess(proc, f"127.0.0.1:{port}", log_path)
    try:
        _wait_serving(handle)
        yield handle
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_serving(handle: CoordinatorProcess) -> None:
    """Poll the health service until ingest is SERVING; fail fast if the process died."""
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(handle.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if handle.proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited at start:\n{handle.log_tail()}")
            try:
                reply = health.Check(
                    health_pb2.HealthCheckRequest(service=INGEST_SERVICE),
                    timeout=0.5,
                    wait_for_ready=True,
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start:\n{handle.log_tail()}")
