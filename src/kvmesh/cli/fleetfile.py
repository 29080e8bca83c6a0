"""The fleet file: where the fleet ``kvmesh up`` started listens.

``kvmesh up`` writes it once every service is ready and removes it when it
stops (its reaper removes it if ``up`` was killed). ``kvmesh status``,
``kvmesh demo`` and ``kvmesh bench`` read it when no address is given, so an
operator never has to copy a random port. Its path is ``$KVMESH_FLEET_FILE``,
else ``$XDG_RUNTIME_DIR/kvmesh/fleet.json``, else
``<tmp>/kvmesh-<uid>/fleet.json``; ``kvmesh up --fleet-file PATH`` chooses
another. A file whose ``up`` process is gone is ignored.

Contents (JSON): ``pid`` of ``up``, ``coordinator`` (gRPC address),
``coordinator_metrics``, ``nodes`` (per node: ``name``, ``storage``,
``gateway``, their ``*_lane`` and ``*_metrics``), ``services`` (every
process: name, grpc, metrics, lane, pid), ``shm_dir``, ``data_dir``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kvmesh.common.procs import pid_alive

FLEET_FILE_ENV = "KVMESH_FLEET_FILE"


def default_path() -> Path:
    """Where ``kvmesh up`` writes the fleet file and the other commands look for it."""
    explicit = os.environ.get(FLEET_FILE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "kvmesh" / "fleet.json"
    return Path(tempfile.gettempdir()) / f"kvmesh-{os.getuid()}" / "fleet.json"


def write(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def remove(path: Path, pid: int) -> None:
    """Remove the fleet file if it is still the one process ``pid`` wrote."""
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
            if path.parent == default_path().parent:
                path.parent.rmdir()  # only when empty (another fleet's file keeps it)
    except (OSError, ValueError, AttributeError):
        pass


def load(path: Path | None = None) -> dict[str, Any] | None:
    """The running fleet's file, or None (no file, unreadable, or its ``up`` is gone)."""
    path = path or default_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        return None
    return data if pid_alive(data["pid"]) else None


def describe(path: Path | None = None) -> str:
    """How the commands found (or did not find) a fleet, for error messages."""
    path = path or default_path()
    return f"fleet file {path}" if load(path) else f"no running fleet in {path}"


def record(fleet: Any) -> dict[str, Any]:
    """What the fleet file of a started :class:`kvmesh.cli.fleet.Fleet` holds."""
    by_name = {c.name: c.endpoints for c in fleet.children}

    def endpoints(name: str) -> dict[str, Any]:
        # In a colocated fleet one process (node-N) serves both of a node's services.
        return by_name.get(name) or by_name.get(name.rsplit("-", 1)[0]) or {}

    nodes = []
    for i in range(fleet.options.nodes):
        storage = endpoints(f"node-{i}-storage")
        gateway = endpoints(f"node-{i}-gateway")
        nodes.append(
            {
                "name": f"node-{i}",
                "storage": storage.get("grpc", ""),
                "storage_lane": storage.get("lane", ""),
                "storage_metrics": storage.get("metrics", ""),
                "gateway": gateway.get("grpc", ""),
                "gateway_lane": gateway.get("lane", ""),
                "gateway_metrics": gateway.get("metrics", ""),
            }
        )
    coordinator = by_name.get("coordinator", {})
    return {
        "pid": os.getpid(),
        "coordinator": coordinator.get("grpc", ""),
        "coordinator_metrics": coordinator.get("metrics", ""),
        "nodes": nodes,
        "services": [{"name": c.name, **c.endpoints} for c in fleet.children],
        "reaper_pid": fleet.reaper_pid,
        "shm_dir": str(fleet.shm_dir),
        "data_dir": str(fleet.data_dir),
    }
