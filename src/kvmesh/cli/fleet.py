"""The local fleet behind ``kvmesh up``: a coordinator and, per node, a storage and a gateway.

Each service runs in its own process (``python -m kvmesh.cli <service>``),
exactly as it would be deployed, on ports the OS picks. A child reports its
bound endpoints through a ready file; ``up`` waits for them in dependency
order (coordinator, then storages, then gateways), prints every endpoint and
then waits. On Ctrl-C or SIGTERM it stops the children in reverse order
(SIGTERM, then SIGKILL after a grace period) and removes what they left: ready
files, unix sockets, the storage nodes' shared-memory segments and, unless
``--data-dir`` was given, the data directory. Exit status 0. SIGHUP (a closed
terminal) stops it the same way.

Nothing outlives ``up`` when it dies without stopping (SIGKILL): every child
stops on its parent's death (kvmesh.cli.startup.follow_parent) and the
fleet's reaper removes the directories (kvmesh.cli.reaper). Once ready,
``up`` writes the fleet file (kvmesh.cli.fleetfile) that ``kvmesh status``,
``demo`` and ``bench`` read by default.

Embedded defaults need no external server: L2 is a directory on local disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.cli import fleetfile
from kvmesh.cli.reaper import PIDS_NAME, FleetLock, reclaim_abandoned, spawn_reaper, stop_reaper
from kvmesh.cli.startup import PARENT_ENV
from kvmesh.common.config import ConfigError
from kvmesh.common.telemetry import TRACE_FILE_ENV

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass
class Child:
    """One service process of the fleet."""

    name: str
    service: str
    args: list[str]
    ready_file: Path
    log_file: Path | None
    process: subprocess.Popen[bytes] | None = None
    endpoints: dict[str, Any] = field(default_factory=dict)


#: The longest a storage node waits between two membership polls (its default
#: --p2p-membership-refresh is 0.5 s; the setting must stay below 1 s).
MEMBERSHIP_POLL_S = 1.0


@dataclass
class FleetOptions:
    """What ``kvmesh up`` (or a test, or ``kvmesh demo``) asks for."""

    nodes: int = 1
    host: str = "127.0.0.1"
    data_dir: Path | None = None
    l1_size_bytes: int = 1 << 30
    chunk_size: int = 256
    startup_timeout_s: float = 60.0
    stop_grace_s: float = 10.0
    verbose: bool = False
    # Run each node's storage and gateway in one process (kvmesh node).
    colocated: bool = False
    extra_storage_args: list[str] = field(default_factory=list)
    extra_gateway_args: list[str] = field(default_factory=list)
    extra_coordinator_args: list[str] = field(default_factory=list)
    # Passed to the services: L2 adapters (storage), a YAML file and a log level (all).
    l2: list[str] = field(default_factory=list)
    config: Path | None = None
    log_level: str | None = None
    # Where to write the fleet file once ready (None: write none, as kvmesh demo's own fleet).
    fleet_file: Path | None = None
    # Every service appends its spans here as JSON lines (KVMESH_TRACE_FILE).
    trace_file: Path | None = None


class Fleet:
    """A running local fleet of child processes."""

    def __init__(self, options: FleetOptions) -> None:
        self.options = options
        self._owns_data_dir = options.data_dir is None
        # The owner's pid in the names: an operator (or a test) sees whose they are.
        tag = f"kvmesh-fleet-{os.getpid()}-"
        self.data_dir = options.data_dir or Path(tempfile.mkdtemp(prefix=tag))
        self.run_dir = self.data_dir / "run"
        self.log_dir = self.data_dir / "logs"
        self.children: list[Child] = []
        # A shared-memory directory of its own, so fleets on one host never collide
        # and everything the nodes map is removed with one rmtree.
        self.shm_dir = Path("/dev/shm") / f"{tag}{uuid.uuid4().hex[:12]}"
        self._lock: FleetLock | None = None
        self.reaper_pid: int | None = None
        #: Where a fleet that failed left its services' logs (see stop).
        self.kept_logs: Path | None = None

    def _child(self, name: str, service: str, args: list[str]) -> Child:
        ready = self.run_dir / f"{name}.ready.json"
        log = None if self.options.verbose else self.log_dir / f"{name}.log"
        common = ["--host", self.options.host, "--port", "0", "--metrics-port", "0"]
        if self.options.config is not None:
            common += ["--config", str(self.options.config)]
        if self.options.log_level:
            common += ["--log-level", self.options.log_level]
        return Child(name, service, [*common, "--ready-file", str(ready), *args], ready, log)

    def _spawn(self, child: Child) -> None:
        cmd = [sys.executable, "-m", "kvmesh.cli", child.service, *child.args]
        out: Any = None
        if child.log_file is not None:
            out = child.log_file.open("ab")
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.options.trace_file is not None:
            env[TRACE_FILE_ENV] = str(self.options.trace_file)
        # The child stops when this process dies, however it dies (SIGKILL included).
        env[PARENT_ENV] = str(os.getpid())
        assert self._lock is not None
        assert self._lock.fd is not None
        child.process = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=out if out is not None else None,
            env=env,
            # The fleet lock: held while any process of the fleet lives (see reaper).
            pass_fds=(self._lock.fd,),
        )
        if out is not None:
            out.close()
        self.children.append(child)
        pids = [c.process.pid for c in self.children if c.process is not None]
        (self.shm_dir / PIDS_NAME).write_text(json.dumps(pids))

    def _wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                assert child.process is not None
                if child.ready_file.exists():
                    child.endpoints = json.loads(child.ready_file.read_text())
                    pending.remove(child)
                elif child.process.poll() is not None:
                    reason = (
                        f"{child.name} exited with status {child.process.returncode} during "
                        f"start-up{self._log_tail(child)}"
                    )
                    # Status 2 is a setting the child refused: the operator's to fix.
                    raise (
                        ConfigError(reason)
                        if child.process.returncode == 2
                        else RuntimeError(reason)
                    )
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise RuntimeError(f"{names} not ready after {self.options.startup_timeout_s} s")
            if pending:
                time.sleep(0.05)

    @staticmethod
    def _log_tail(child: Child) -> str:
        if child.log_file is None or not child.log_file.exists():
            return ""
        lines = child.log_file.read_text(errors="replace").strip().splitlines()
        # The child's own one-line reason is its last line; the whole log stays on disk.
        return f": {lines[-1].strip()} (log: {child.log_file})" if lines else ""

    def start(self) -> None:
        """Start every service in dependency order; raises RuntimeError if one fails."""
        # What fleets with no live process left behind (a SIGKILL, a lost reaper).
        reclaim_abandoned()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.shm_dir.mkdir(mode=0o700)
        opts = self.options
        # Gateway ports held from their storage node's start to their own (see below).
        reserved: list[socket.socket] = []
        try:
            self._lock = FleetLock(
                self.shm_dir,
                {
                    "pid": os.getpid(),
                    "data_dir": str(self.data_dir),
                    "owns_data_dir": self._owns_data_dir,
                    "fleet_file": str(opts.fleet_file) if opts.fleet_file else "",
                },
            )
            self.reaper_pid = spawn_reaper(os.getpid(), self.shm_dir)
            coordinator = self._child(
                "coordinator",
                "coordinator",
                [
                    "--chunk-size", str(opts.chunk_size),
                    "--checkpoint-path", str(self.data_dir / "coordinator" / "checkpoint.bin"),
                    "--metadata-path", str(self.data_dir / "coordinator" / "metadata.json"),
                    *opts.extra_coordinator_args,
                ],
            )  # fmt: skip
            self._spawn(coordinator)
            self._wait_ready([coordinator])
            storages = []
            for i in range(opts.nodes):
                node = f"node-{i}"
                storage_args = [
                    "--instance-id", node,
                    "--coordinator-target", coordinator.endpoints["grpc"],
                    "--data-dir", str(self.data_dir / node),
                    "--l1-size-bytes", str(opts.l1_size_bytes),
                    "--shm-dir", str(self.shm_dir),
                    *(arg for l2 in opts.l2 for arg in ("--l2", l2)),
                    *opts.extra_storage_args,
                ]  # fmt: skip
                if opts.host in ("0.0.0.0", "::"):
                    # Peers (P2P) dial what a node advertises; this fleet's nodes are local.
                    storage_args += ["--advertise-address", "127.0.0.1"]
                if opts.colocated:
                    # One process per node: storage and gateway, linked in-process.
                    args = [*storage_args, "--chunk-size", str(opts.chunk_size), *self._lane(i)]
                    child = self._child(node, "node", [*args, *opts.extra_gateway_args])
                else:
                    storage_lane = ["--lane-socket", str(self.shm_dir / f"{node}-storage.lane")]
                    # The gateway's port, held until it starts, so that the storage node
                    # registers the gateway's address with the coordinator (ListInstances).
                    reserved.append(_reserve_port(opts.host))
                    shown = f"[{opts.host}]" if ":" in opts.host else opts.host
                    gateway_address = f"{shown}:{reserved[-1].getsockname()[1]}"
                    storage_lane += ["--gateway-address", gateway_address]
                    child = self._child(
                        f"{node}-storage", "storage", [*storage_args, *storage_lane]
                    )
                self._spawn(child)
                storages.append(child)
            self._wait_ready(storages)
            if opts.nodes > 1:
                self._wait_peers(storages)
            if opts.colocated:
                self._write_fleet_file()
                return
            gateways = []
            for i, storage in enumerate(storages):
                port = reserved[i].getsockname()[1]
                reserved[i].close()  # the gateway binds it next
                gateway = self._child(
                    f"node-{i}-gateway",
                    "gateway",
                    [
                        # Same host: the gateway reaches its storage node on the local lane.
                        "--storage-target", storage.endpoints["lane"],
                        "--chunk-size", str(opts.chunk_size),
                        *self._lane(i),
                        "--port", str(port),
                        *opts.extra_gateway_args,
                    ],
                )  # fmt: skip
                self._spawn(gateway)
                gateways.append(gateway)
            self._wait_ready(gateways)
            self._write_fleet_file()
        except BaseException:
            for sock in reserved:
                sock.close()
            # The error names a log file: it stays for the operator to read.
            self.stop(keep_logs=True)
            raise

    def _wait_peers(self, storages: list[Child]) -> None:
        """Wait until every node that fetches from peers lists all the others.

        Nodes list the members in the background (docs/p2p.md), so a node
        sees another at its next poll; a fleet reported ready has no such gap.
        """
        import grpc

        from kvmesh.api.storage.v1 import storage_pb2, storage_pb2_grpc

        started = time.monotonic()
        deadline = started + self.options.startup_timeout_s
        for child in storages:
            with grpc.insecure_channel(str(child.endpoints["grpc"])) as channel:
                stub = storage_pb2_grpc.StorageServiceStub(channel)
                while True:
                    p2p = stub.GetStatus(storage_pb2.GetStatusRequest(), timeout=10).p2p
                    if not p2p.enabled or p2p.peers >= len(storages) - 1:
                        break
                    if p2p.peers == -1 and time.monotonic() - started > 2 * MEMBERSHIP_POLL_S:
                        break  # no listing yet: polls are off (it lists at its first miss)
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{child.name} lists {p2p.peers} peers after "
                            f"{self.options.startup_timeout_s} s, not {len(storages) - 1}"
                        )
                    time.sleep(0.05)

    def _write_fleet_file(self) -> None:
        if self.options.fleet_file is not None:
            fleetfile.write(self.options.fleet_file, fleetfile.record(self))

    def _lane(self, node: int) -> list[str]:
        """Flags giving node ``node``'s gateway its local lane, in the fleet's private dir."""
        return ["--lane-socket", str(self.shm_dir / f"node-{node}.lane")]

    def endpoint(self, name: str, kind: str = "grpc") -> str:
        """Bound endpoint of a child ('coordinator', 'node-0-storage', 'node-0-gateway').

        In a colocated fleet 'node-0-storage' and 'node-0-gateway' both name
        the 'node-0' process, which serves both services.
        """
        names = {name}
        if self.options.colocated and name.endswith(("-storage", "-gateway")):
            names.add(name.rsplit("-", 1)[0])
        for child in self.children:
            if child.name in names:
                return str(child.endpoints[kind])
        raise KeyError(name)

    def describe(self) -> list[str]:
        """One line per service: name, gRPC address, metrics address, pid (and its lane)."""
        lines = []
        for child in self.children:
            e = child.endpoints
            lines.append(
                f"  {child.name:<16} grpc {e.get('grpc', '?'):<22} "
                f"metrics http://{e.get('metrics', '?')}/metrics  pid {e.get('pid', '?')}"
            )
            if e.get("lane"):
                lines.append(f"  {'':<16} lane {e['lane']}  (same-host clients)")
        return lines

    def stop(self, *, keep_logs: bool = False) -> None:
        """SIGTERM every child in reverse order, SIGKILL stragglers, remove leftovers.

        ``keep_logs``: a fleet that failed keeps its services' logs (the rest
        of a data directory of its own goes); :attr:`kept_logs` says where.
        """
        for child in reversed(self.children):
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(timeout=self.options.stop_grace_s)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait(timeout=5)
        for child in self.children:
            with contextlib.suppress(FileNotFoundError):
                child.ready_file.unlink()
        if self.options.fleet_file is not None:
            fleetfile.remove(self.options.fleet_file, os.getpid())
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        if self._owns_data_dir:
            if keep_logs and any(self.log_dir.glob("*")):
                for entry in self.data_dir.iterdir():
                    if entry == self.log_dir:
                        continue
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
                self.kept_logs = self.log_dir
            else:
                shutil.rmtree(self.data_dir, ignore_errors=True)
        elif keep_logs:
            self.kept_logs = self.log_dir
        if self._lock is not None:
            self._lock.release()
        if self.reaper_pid is not None:
            stop_reaper(self.reaper_pid)  # this fleet cleaned up itself
            self.reaper_pid = None
        self.children = []

    def alive(self) -> list[str]:
        """Names of children still running."""
        return [c.name for c in self.children if c.process is not None and c.process.poll() is None]


def _reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port of ``host`` (no SO_REUSEADDR: nobody else can bind it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot find a free port on {host}: {exc.strerror or exc}") from exc
    return sock
