"""``kvmesh up``: the command that starts a :class:`kvmesh.cli.fleet.Fleet` and waits.

Its options, what it prints, and how it stops: on Ctrl-C, SIGTERM or SIGHUP
it stops the fleet cleanly (exit 0); when a service exits on its own it stops
the rest and keeps the services' logs (exit 1); a fleet that cannot start
says why in one line and keeps its logs too.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from kvmesh.cli import fleetfile
from kvmesh.cli.fleet import LOG_LEVELS, Fleet, FleetOptions
from kvmesh.cli.traces import checked_trace_file
from kvmesh.common.config import ConfigError, parse_size
from kvmesh.common.telemetry import TRACING_HELP


def add_up_command(sub: Any) -> None:
    """Register ``kvmesh up`` on the CLI's subparsers."""
    p = sub.add_parser(
        "up",
        help="run a whole local fleet (coordinator + storage and gateway per node) until Ctrl-C",
        description="Run a local fleet with embedded defaults (L2 on local disk, no external "
        "server) until Ctrl-C or SIGTERM, then stop it leaving nothing behind.",
    )
    p.add_argument("--nodes", type=int, default=1, help="storage+gateway nodes (default: 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="keep checkpoints, L2 files and logs here (default: a temporary directory, "
        "removed on exit)",
    )
    p.add_argument("--l1-size", default="1GiB", help="L1 memory per node (default: 1GiB)")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default: 256)")
    p.add_argument(
        "--colocated",
        action="store_true",
        help="run each node's storage and gateway in one process (kvmesh node): one gRPC hop "
        "less per engine request",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show the services' logs here instead of in files"
    )
    p.add_argument(
        "--l2",
        action="append",
        default=None,
        metavar="L2",
        help="L2 adapter of every node, repeatable in priority order: disk (the default), "
        'none, or JSON such as \'{"type": "redis", "url": "redis://127.0.0.1:6379"}\' '
        "(redis needs pip install 'kvmesh[redis]', s3 'kvmesh[s3]', nixl 'kvmesh[nixl]')",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML settings file given to every service (one section per service: "
        "coordinator:, storage:, gateway:, node:)",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        default=None,
        choices=LOG_LEVELS,
        help="log level of every service (default: INFO)",
    )
    p.add_argument(
        "--fleet-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the fleet's addresses here once it is up (default: "
        f"${fleetfile.FLEET_FILE_ENV}, else a file of this fleet's own in "
        f"{fleetfile.registry_dir()}, where kvmesh status, demo and bench look)",
    )
    p.add_argument(
        "--trace-file",
        type=Path,
        default=None,
        help="append every service's spans to this file, one JSON line each (read it with "
        "kvmesh traces FILE [TRACE_ID]); the OTEL_* variables below also reach every service",
    )
    p.epilog = TRACING_HELP
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.set_defaults(handler=run_up)


def run_up(args: argparse.Namespace) -> int:
    """``kvmesh up``: start the fleet, print endpoints, wait for a signal, stop."""
    from kvmesh.cli.preflight import check_settings

    if args.nodes < 1:
        raise ConfigError("--nodes must be >= 1")
    options = FleetOptions(
        nodes=args.nodes,
        host=args.host,
        data_dir=args.data_dir,
        l1_size_bytes=parse_size(args.l1_size),
        chunk_size=args.chunk_size,
        verbose=args.verbose,
        trace_file=checked_trace_file(args.trace_file),
        colocated=args.colocated,
        l2=args.l2 or [],
        config=args.config.resolve() if args.config else None,
        log_level=args.log_level,
        fleet_file=(args.fleet_file or fleetfile.default_path()).resolve(),
    )
    check_settings(options)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    # SIGHUP: the terminal was closed; stop the same clean way.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    fleet = Fleet(options)
    try:
        fleet.start()
    except RuntimeError as exc:
        print(f"kvmesh up: error: {exc}", file=sys.stderr)
        if fleet.kept_logs is not None:
            print(f"kvmesh up: the services' logs are kept in {fleet.kept_logs}", file=sys.stderr)
        return 1
    print("kvmesh fleet is up:", flush=True)
    for line in fleet.describe():
        print(line, flush=True)
    print(f"  shared memory in {fleet.shm_dir}", flush=True)
    if options.trace_file is not None:
        print(f"  spans in {options.trace_file}  (one JSON line each)", flush=True)
    print(f"  data and logs in {fleet.data_dir}", flush=True)
    print(
        f"  fleet file {options.fleet_file}  (kvmesh status, demo and bench use it; "
        "Ctrl-C to stop)",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            gone = [c.name for c in fleet.children if c.process and c.process.poll() is not None]
            if gone:
                print(f"kvmesh up: {', '.join(gone)} exited; stopping the fleet", file=sys.stderr)
                fleet.stop(keep_logs=True)
                if fleet.kept_logs is not None:
                    print(f"kvmesh up: logs kept in {fleet.kept_logs}", file=sys.stderr)
                return 1
    finally:
        fleet.stop()
    print("kvmesh fleet stopped", flush=True)
    return 0
