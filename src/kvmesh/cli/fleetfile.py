"""Fleet files: where each fleet ``kvmesh up`` started listens.

Every ``kvmesh up`` writes a file of its own, once every service is ready, and
removes it when it stops (its reaper removes it if ``up`` was killed), so two
fleets of one user never overwrite or delete each other's. The files live in
one directory, the registry: ``$KVMESH_FLEET_DIR``, else
``$XDG_RUNTIME_DIR/kvmesh/fleets``, else ``<tmp>/kvmesh-<uid>/fleets``; each is
named after its ``up`` process (``fleet-<pid>.json``).

``kvmesh status``, ``kvmesh demo`` and ``kvmesh bench`` read the registry when
no address is given, so an operator never copies a random port:

- a file whose ``up`` is gone (its process, or its shared-memory directory)
  is stale: ignored, and removed from the registry;
- one live fleet: that one;
- several: the newest, and the command says so on stderr, naming the others
  and how to pick one (``KVMESH_FLEET_FILE``).

``$KVMESH_FLEET_FILE`` (or ``kvmesh up --fleet-file PATH``) names one file
instead of the registry, for scripts that want a fixed path.

Contents (JSON): ``pid`` of ``up``, ``started`` (Unix time), ``coordinator``
(gRPC address), ``coordinator_metrics``, ``nodes`` (per node: ``name``,
``storage``, ``gateway``, their ``*_lane`` and ``*_metrics``), ``services``
(every process: name, grpc, metrics, lane, pid), ``shm_dir``, ``data_dir``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.common.procs import pid_alive

FLEET_FILE_ENV = "KVMESH_FLEET_FILE"
FLEET_DIR_ENV = "KVMESH_FLEET_DIR"


def registry_dir() -> Path:
    """The directory every ``kvmesh up`` writes its fleet file into."""
    explicit = os.environ.get(FLEET_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "kvmesh" / "fleets"
    return Path(tempfile.gettempdir()) / f"kvmesh-{os.getuid()}" / "fleets"


def default_path(pid: int | None = None) -> Path:
    """The file ``kvmesh up`` (process ``pid``, default this one) writes."""
    explicit = os.environ.get(FLEET_FILE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    return registry_dir() / f"fleet-{pid if pid is not None else os.getpid()}.json"


def where() -> str:
    """Where the readers look, for help texts and error messages."""
    explicit = os.environ.get(FLEET_FILE_ENV)
    return f"${FLEET_FILE_ENV}={explicit}" if explicit else str(registry_dir())


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
    except (OSError, ValueError, AttributeError):
        pass


def _read(path: Path) -> dict[str, Any] | None:
    """The file's contents if its fleet is alive; None otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        return None
    if not pid_alive(data["pid"]):
        return None
    # A reused pid: the fleet's private shared-memory dir goes when the fleet does.
    shm_dir = data.get("shm_dir")
    if isinstance(shm_dir, str) and shm_dir and not Path(shm_dir).is_dir():
        return None
    return data


@dataclass
class Running:
    """The fleet a command uses, and the other live fleets it did not pick."""

    path: Path
    data: dict[str, Any]
    others: list[Path] = field(default_factory=list)

    def note(self) -> str | None:
        """A line for stderr when several fleets run; None when the choice was the only one."""
        if not self.others:
            return None
        names = ", ".join(str(p) for p in self.others)
        return (
            f"kvmesh: {len(self.others) + 1} fleets are running; using the newest, {self.path} "
            f"(others: {names}); pick one with {FLEET_FILE_ENV}=PATH"
        )


def find() -> Running | None:
    """The live fleet the commands use by default, or None (stale files are removed)."""
    explicit = os.environ.get(FLEET_FILE_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        data = _read(path)
        return Running(path, data) if data is not None else None
    live: list[tuple[float, Path, dict[str, Any]]] = []
    with contextlib.suppress(OSError):
        for path in registry_dir().glob("fleet-*.json"):
            data = _read(path)
            if data is None:
                # Stale: its kvmesh up is gone (files are written whole, never half).
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            started = data.get("started")
            live.append((float(started) if isinstance(started, int | float) else 0.0, path, data))
    if not live:
        return None
    live.sort(key=lambda item: (item[0], item[1].name))
    _, path, data = live[-1]
    return Running(path, data, [p for _, p, _ in reversed(live[:-1])])


def describe(running: Running | None = None) -> str:
    """How the commands found (or did not find) a fleet, for messages."""
    if running is not None:
        return f"fleet file {running.path}"
    return f"no running fleet in {where()}"


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
        "started": time.time(),
        "coordinator": coordinator.get("grpc", ""),
        "coordinator_metrics": coordinator.get("metrics", ""),
        "nodes": nodes,
        "services": [{"name": c.name, **c.endpoints} for c in fleet.children],
        "reaper_pid": fleet.reaper_pid,
        "shm_dir": str(fleet.shm_dir),
        "data_dir": str(fleet.data_dir),
    }
