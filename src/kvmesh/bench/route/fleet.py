"""The routing benchmark's fleet: a coordinator, and per engine a kvmesh node and a vLLM server.

Started as an operator starts them (docs/routing.md):

- ``kvmesh coordinator`` following every engine's vLLM KV events (an
  engines file naming each engine's event and replay endpoints, the model
  name kvmesh's connector keys its chunks with, and the engine's node);
- per engine a ``kvmesh node`` with its own instance id, reporting its
  cache to the coordinator (L2 off; P2P only with ``--p2p``);
- per engine vLLM's OpenAI server with kvmesh's connector on its node's
  lane and KV events published on ZMQ (``--kv-events-config``), on unix
  sockets in the run's folder (:func:`event_endpoints`).

The two vLLM servers start side by side. Every process is stopped by
:meth:`Fleet.close`, also when a start fails or the run is interrupted.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvmesh.bench.common import Progress
from kvmesh.bench.serve.servers import (
    Node,
    Process,
    Server,
    launch_vllm,
    spawn,
    start_node,
    wait_ready,
    wait_serving,
)

from .params import BLOCK_SIZE, CHUNK, ENGINES

#: Seconds a process has to end after SIGTERM before it is killed (a vLLM stopped while it
#: starts may hang in its shutdown; one that serves stops in under a second).
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Sizes:
    """What the fleet's processes are given."""

    kv_blocks: int  # vLLM's KV cache, in blocks of BLOCK_SIZE tokens
    kv_cache_gib: int  # VLLM_CPU_KVCACHE_SPACE
    max_model_len: int
    l1_size: str  # each node's --l1-size-bytes
    p2p: bool
    omp_binds: list[str]  # per engine


@dataclass(frozen=True)
class Engine:
    """One engine: its id at the coordinator, its node and its vLLM server."""

    engine_id: str
    instance_id: str
    node: Node
    server: Server


@dataclass
class Fleet:
    """The running fleet; a context manager that stops every process on leaving."""

    coordinator: str = ""  # host:port of its gRPC server
    engines: list[Engine] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)

    def close(self) -> None:
        """Stop every process, the last started first."""
        while self.processes:
            self.processes.pop().stop(STOP_GRACE_S)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def start_fleet(work: Path, model: Path, sizes: Sizes, progress: Progress) -> Fleet:
    """Start the coordinator, the nodes and the vLLM servers; all stopped again on failure."""
    fleet = Fleet()
    try:
        _start(fleet, work, model, sizes, progress)
    except BaseException:
        fleet.close()
        raise
    return fleet


#: The longest path a unix socket address holds (sun_path, less its NUL).
UNIX_PATH_MAX = 107


def event_endpoints(work: Path, engine_id: str) -> tuple[str, str]:
    """ZMQ ``ipc://`` endpoints for an engine's KV events and its replay socket.

    Unix sockets, not TCP ports picked ahead: vLLM binds its event sockets
    in the engine core, tens of seconds after the benchmark would have
    picked a free port, and a port picked that early may meanwhile be taken
    by any other process on the host (the engine core then fails to start).
    """
    paths = (work / f"{engine_id}-events.sock", work / f"{engine_id}-replay.sock")
    for path in paths:
        if len(str(path)) > UNIX_PATH_MAX:
            raise RuntimeError(
                f"the unix socket path {path} is longer than {UNIX_PATH_MAX} bytes; "
                "set TMPDIR to a shorter folder"
            )
    return f"ipc://{paths[0]}", f"ipc://{paths[1]}"


def _start(fleet: Fleet, work: Path, model: Path, sizes: Sizes, progress: Progress) -> None:
    ids = [(f"engine-{i}", f"route-node-{i}") for i in range(ENGINES)]
    endpoints = [event_endpoints(work, engine_id) for engine_id, _ in ids]
    specs = [
        {
            "engine_id": engine_id,
            "endpoint": events,
            "replay_endpoint": replay,
            "model_name": str(model),  # the connector's model_name: vLLM's --model
            "instance_id": instance_id,
        }
        for (engine_id, instance_id), (events, replay) in zip(ids, endpoints, strict=True)
    ]
    engines_file = work / "engines.json"
    engines_file.write_text(json.dumps(specs))
    progress.phase(f"starting a kvmesh coordinator following {ENGINES} engines")
    fleet.coordinator = _start_coordinator(fleet, work, engines_file)

    nodes = []
    for i, (_, instance_id) in enumerate(ids):
        progress.phase(f"starting kvmesh node {instance_id}")
        folder = work / f"node-{i}"
        folder.mkdir()
        extra = [
            "--instance-id", instance_id, "--coordinator-target", fleet.coordinator,
            "--l2", "none", "--p2p" if sizes.p2p else "--no-p2p",
        ]  # fmt: skip
        node = start_node(folder, sizes.l1_size, CHUNK, extra)
        fleet.processes.append(node.process)
        nodes.append(node)

    progress.phase(
        f"starting {ENGINES} vLLM servers ({sizes.kv_blocks} KV blocks of {BLOCK_SIZE} tokens each)"
    )
    servers = []
    for (engine_id, _), (events, replay), node, bind in zip(
        ids, endpoints, nodes, sizes.omp_binds, strict=True
    ):
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events,  # an ipc:// endpoint: vLLM binds it
            "replay_endpoint": replay,
        }
        server = launch_vllm(
            work,
            engine_id,
            model,
            kv_blocks=sizes.kv_blocks,
            kv_cache_gib=sizes.kv_cache_gib,
            block_size=BLOCK_SIZE,
            max_model_len=sizes.max_model_len,
            gateway=node.lane,
            omp_bind=bind,
            extra_args=["--kv-events-config", json.dumps(kv_events)],
        )
        fleet.processes.append(server.process)
        servers.append(server)
    for server in servers:
        wait_serving(server)
    fleet.engines = [
        Engine(engine_id, instance_id, node, server)
        for (engine_id, instance_id), node, server in zip(ids, nodes, servers, strict=True)
    ]


def _start_coordinator(fleet: Fleet, work: Path, engines_file: Path) -> str:
    """``kvmesh coordinator`` on a free port; its gRPC address."""
    ready = work / "coordinator-ready.json"
    argv = [
        sys.executable, "-m", "kvmesh.cli", "coordinator", "--port", "0",
        "--metrics-port", "-1", "--chunk-size", str(CHUNK),
        "--engine-events-file", str(engines_file), "--ready-file", str(ready),
    ]  # fmt: skip
    process = spawn("kvmesh coordinator", argv, work / "coordinator.log", dict(os.environ))
    fleet.processes.append(process)
    wait_ready(ready.exists, process, 60, "kvmesh coordinator")
    return str(json.loads(ready.read_text())["grpc"])
