"""The servers of each arrangement, started and stopped.

Child processes (``kvmesh node``, or ``kvmesh storage`` and ``kvmesh
gateway`` apart) or both servers in a thread of this process.

Each arrangement is a context manager yielding the :class:`~.params.Endpoints`
to dial; child processes are stopped (SIGTERM, then SIGKILL) on the way out.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvmesh.bench.common import LoopThread
from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.config import GatewayConfig
from kvmesh.rpc.server import Server, create_server
from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig

from .params import Endpoints, Params

_MIB = 1 << 20
_STARTUP_TIMEOUT_S = 60.0


def _storage_settings(params: Params, work_dir: Path, data_dir: Path) -> dict[str, Any]:
    # L1 holds the prompt many times over, so nothing is ever evicted.
    segment = max(4 * _MIB, 4 * params.chunk_bytes)
    l1 = max(16 * _MIB, 4 * params.chunks * params.chunk_bytes + segment)
    l1 = -(-l1 // segment) * segment
    transport = {}
    if params.storage_transport == "unix":
        transport["unix_socket"] = str(data_dir / "storage.sock")
    return {
        **transport,
        "instance_id": f"bench-lookup-{uuid.uuid4().hex[:8]}",
        "data_dir": str(data_dir),
        "l1_size_bytes": l1,
        "l1_segment_bytes": segment,
        "shm_dir": str(work_dir),
        "allowed_memory_dir": str(work_dir),
        "l2": ["none"],
        "max_chunks_per_request": max(4096, params.chunks),
        "log_level": "WARNING",
    }


def _gateway_settings(params: Params, storage_target: str) -> dict[str, Any]:
    return {
        "storage_target": storage_target,
        "chunk_size": params.chunk_tokens,
        "max_tokens": max(1_000_000, params.tokens),
        "hash_memo_entries": params.hash_memo_entries,
        # The bench's engine registers once and never beats (lookups name no engine):
        # a long run must not have it reaped and measure misses.
        "engine_reap_seconds": 0,
        "log_level": "WARNING",
    }


def _flags(settings: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        for item in value if isinstance(value, list) else [value]:
            out += [flag, str(item)]
    return out


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    ready: Path
    log: Path


# A service process whose main thread (its asyncio loop) runs under cProfile between
# SIGUSR1 and SIGUSR2, so the profile holds the timed requests only, not start-up.
_PROFILED_CHILD = """
import cProfile, signal, sys
from kvmesh.cli import main as cli
profile = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
signal.signal(signal.SIGUSR2, lambda *_: profile.disable())
out, argv = sys.argv[1], sys.argv[2:]
try:
    code = cli.main(argv)
finally:
    profile.disable()
    profile.dump_stats(out)
sys.exit(code)
"""


def _spawn(
    name: str, service: str, settings: dict[str, Any], run_dir: Path, profile: Path | None
) -> _Child:
    ready = run_dir / f"{name}.ready.json"
    log = run_dir / f"{name}.log"
    common = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "ready_file": str(ready)}
    argv = [service, *_flags({**common, **settings})]
    cmd = [sys.executable, "-m", "kvmesh.cli", *argv]
    if profile is not None:
        cmd = [sys.executable, "-c", _PROFILED_CHILD, str(profile), *argv]
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return _Child(name, process, ready, log)


def _wait_ready(child: _Child) -> dict[str, Any]:
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not child.ready.exists():
        if child.process.poll() is not None:
            tail = child.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(
                f"{child.name} exited with status {child.process.returncode}: " + " | ".join(tail)
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not ready after {_STARTUP_TIMEOUT_S} s")
        time.sleep(0.02)
    endpoints: dict[str, Any] = json.loads(child.ready.read_text())
    return endpoints


def _stop(child: _Child) -> None:
    if child.process.poll() is None:
        child.process.send_signal(signal.SIGTERM)
        try:
            child.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait(timeout=5)


@contextlib.contextmanager
def processes(
    params: Params,
    work_dir: Path,
    data_dir: Path,
    profile_dir: Path | None,
    *,
    lane: bool = False,
) -> Iterator[Endpoints]:
    """``kvmesh storage`` and ``kvmesh gateway`` as child processes.

    With ``lane`` both hops (engine -> gateway -> storage) take the local lane.
    """
    run_dir = data_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    children: list[_Child] = []
    try:
        sprof = profile_dir / "storage.prof" if profile_dir else None
        s_settings = _storage_settings(params, work_dir, data_dir)
        g_lane = {}
        if lane:
            s_settings["lane_socket"] = str(run_dir / "storage.lane")
            g_lane["lane_socket"] = str(run_dir / "gateway.lane")
        storage = _spawn("storage", "storage", s_settings, run_dir, sprof)
        children.append(storage)
        s_end = _wait_ready(storage)
        gprof = profile_dir / "gateway.prof" if profile_dir else None
        g_settings = {**_gateway_settings(params, s_end["lane" if lane else "grpc"]), **g_lane}
        gateway = _spawn("gateway", "gateway", g_settings, run_dir, gprof)
        children.append(gateway)
        g_end = _wait_ready(gateway)
        pids = [c.process.pid for c in children] if profile_dir else []
        target = g_end["lane" if lane else "grpc"]
        yield Endpoints(target, g_end["metrics"], s_end["metrics"], pids)
    finally:
        for child in reversed(children):
            _stop(child)


@contextlib.contextmanager
def node_process(
    params: Params, work_dir: Path, data_dir: Path, *, lane: bool
) -> Iterator[Endpoints]:
    """One ``kvmesh node`` process serving both services, linked in-process.

    With ``lane`` the node also serves its local lane and the engine dials that.
    """
    run_dir = data_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = {**_storage_settings(params, work_dir, data_dir), **_gateway_settings(params, "")}
    del settings["storage_target"]
    if lane:
        settings["lane_socket"] = str(run_dir / "lane.sock")
    child = _spawn("node", "node", settings, run_dir, None)
    try:
        ends = _wait_ready(child)
        target = ends["lane"] if lane else ends["grpc"]
        yield Endpoints(target, ends["metrics"], ends["metrics"], [])
    finally:
        _stop(child)


@contextlib.contextmanager
def in_process(params: Params, work_dir: Path, data_dir: Path) -> Iterator[Endpoints]:
    """Both servers on one loop in a background thread of this process."""
    loop = LoopThread("kvmesh-bench-servers")
    servers: list[Server] = []
    try:

        async def start() -> None:
            storage_config = StorageConfig(
                port=0, metrics_port=0, **_storage_settings(params, work_dir, data_dir)
            )
            storage = create_server(
                storage_config, StorageApp(storage_config), registry=CollectorRegistry()
            )
            await storage.start()
            servers.append(storage)
            gateway_config = GatewayConfig(
                port=0, metrics_port=0, **_gateway_settings(params, storage.target)
            )
            gateway = create_server(
                gateway_config, GatewayApp(gateway_config), registry=CollectorRegistry()
            )
            await gateway.start()
            servers.append(gateway)

        loop.run(start())
        storage, gateway = servers
        yield Endpoints(
            gateway.target,
            gateway.endpoints()["metrics"],
            storage.endpoints()["metrics"],
            [],
        )
    finally:
        for server in reversed(servers):
            with contextlib.suppress(Exception):
                loop.run(server.stop(1.0))
        loop.close()
