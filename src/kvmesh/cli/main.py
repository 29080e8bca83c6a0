"""The ``kvmesh`` command line: run a service, a local fleet, and the tools around them.

Every problem with the command line or configuration ends the program with a
one-line reason and exit status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from kvmesh.cli.startup import StartupLogs, follow_parent, one_line, reserve_port
from kvmesh.common.config import (
    ConfigError,
    add_config_arguments,
    describe,
    require_module,
    resolve,
)
from kvmesh.common.sigterm import exit_on_sigterm
from kvmesh.common.telemetry import TRACING_HELP, configure_logging
from kvmesh.rpc.server import ServerSettings, ServiceApp, create_server, run_until_signalled

logger = logging.getLogger(__name__)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class ServiceCommand:
    """A ``kvmesh <service>`` subcommand: its config class and app factory (by import path)."""

    name: str
    help: str
    config: str  # "module:Class"
    app: str  # "module:Class"

    def load(self, ref: str) -> Any:
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)


SERVICES: list[ServiceCommand] = [
    ServiceCommand(
        "coordinator",
        "run the fleet coordinator (event ingest, directory, membership, policy)",
        "kvmesh.coordinator.config:CoordinatorConfig",
        "kvmesh.coordinator.app:CoordinatorApp",
    ),
    ServiceCommand(
        "storage",
        "run the storage service of one node (L1 memory, L2 adapters, event emitter)",
        "kvmesh.storage.config:StorageConfig",
        "kvmesh.storage.app:StorageApp",
    ),
    ServiceCommand(
        "node",
        "run one node's storage and gateway in a single process (in-process link between them)",
        "kvmesh.node.config:NodeConfig",
        "kvmesh.node.app:NodeApp",
    ),
    ServiceCommand(
        "gateway",
        "run the engine-facing gateway of one node",
        "kvmesh.gateway.config:GatewayConfig",
        "kvmesh.gateway.app:GatewayApp",
    ),
]


async def _serve(
    settings: ServerSettings, factory: Callable[[Any], ServiceApp], logs: StartupLogs
) -> None:
    settings, reservation = reserve_port(settings)
    try:
        app = factory(settings)
        try:
            server = create_server(settings, app)
        except BaseException:
            # Nothing will serve: give back what building the app took (a storage
            # node's shared-memory segments would otherwise outlive the process).
            discard = getattr(app, "discard", None)
            if callable(discard):
                await discard()
            raise
    finally:
        if reservation is not None:
            reservation.close()
    logs.release()
    await run_until_signalled(server)


def run_service(command: ServiceCommand, settings: ServerSettings) -> int:
    """Run one service in this process until SIGTERM/SIGINT/SIGHUP.

    Raises what a failed start raised (the caller turns it into one line);
    the log records of a failed start are not printed (unless at DEBUG).
    """
    follow_parent()
    configure_logging(command.name, settings.log_level)
    for line in describe(settings):
        logger.debug("config: %s", line)
    logs = StartupLogs(show_on_failure=settings.log_level.upper() == "DEBUG")
    try:
        factory = command.load(command.app)
        asyncio.run(_serve(settings, factory, logs))
    finally:
        logs.drop()
    return 0


# ``kvmesh bench <name>``: module with add_arguments(parser), run(args) -> dict, format_table(dict).
BENCHES = {
    "blend": (
        "kvmesh.bench.blend",
        "CacheBlend on SmolLM2: TTFT, reused tokens and output quality vs a full prefill",
    ),
    "datapath": (
        "kvmesh.bench.datapath",
        "store/retrieve GB/s of 32 MiB chunks vs memcpy (same run)",
    ),
    "ingest": (
        "kvmesh.bench.ingest",
        "coordinator ingest entries/s, ack p99, stalls, lookups, bytes/key",
    ),
    "lookup": (
        "kvmesh.bench.lookup",
        "gateway lookup p50/p99 of a 32-chunk prefix in L1, empty RTT",
    ),
    "p2p": ("kvmesh.bench.p2p", "node B fetching node A's 32 MiB chunks over P2P vs loopback TCP"),
    "route": (
        "kvmesh.bench.route",
        "routing by the coordinator's ScoreEngines vs round robin vs an oracle, through real vLLM",
    ),
    "score": (
        "kvmesh.bench.score",
        "ScoreEngines p50/p99 for an 8000-token prompt over 16 engines while their events flow",
    ),
    "serve": (
        "kvmesh.bench.serve",
        "vLLM's OpenAI server under multi-document QA: alone, its floor, with kvmesh",
    ),
    "vllm": (
        "kvmesh.bench.vllm",
        "real vLLM's TTFT: cold, kvmesh miss, warm from kvmesh, vLLM's own prefix-cache hit",
    ),
}


def add_bench_command(sub: Any) -> None:
    """List ``kvmesh bench`` in the help; main() runs it (see run_bench)."""
    sub.add_parser(
        "bench",
        help="run a benchmark and print its figures (--json for one JSON object)",
        description="Run a benchmark: "
        + "; ".join(f"{name}: {text}" for name, (_, text) in BENCHES.items()),
        add_help=False,
    )


def run_bench(argv: Sequence[str]) -> int:
    """``kvmesh bench NAME [options]``; a benchmark (and torch) is imported only when it runs."""
    names = OneLineParser(
        prog="kvmesh bench",
        description="Run a benchmark: "
        + "; ".join(f"{name}: {text}" for name, (_, text) in BENCHES.items()),
    )
    names.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    if not argv or argv[0] in ("-h", "--help"):
        names.parse_args(argv or ["--help"])
    # The name may come after options (``kvmesh bench --json lookup``): the first
    # word that names a benchmark is the name, everything else its options.
    at = next((i for i, word in enumerate(argv) if word in BENCHES), None)
    if at is None:
        word = next((w for w in argv if not w.startswith("-")), None)
        names.error(
            f"argument name: invalid choice: {word!r} (choose from {', '.join(sorted(BENCHES))})"
            if word is not None
            else "the following arguments are required: name"
        )
    chosen = names.parse_args([argv[at]])
    argv = [*argv[:at], *argv[at + 1 :]]
    module = importlib.import_module(BENCHES[chosen.name][0])
    # The benchmarks run storage nodes (the "storage" extra) unless a module says otherwise.
    for package in getattr(module, "REQUIRES", ("torch",)):
        require_module(package)
    options = bench_parser(chosen.name, module).parse_args(argv)
    # SIGTERM ends a benchmark as Ctrl-C does: its finally blocks stop the servers it
    # started and remove their shared-memory directories.
    exit_on_sigterm()
    # Progress goes to stderr while it runs (see kvmesh.bench.common.Progress); stdout
    # is the result alone.
    try:
        result = module.run(options)
    except ConfigError as exc:  # an option the benchmark refused: one line, exit 2
        return _fail(f"bench {chosen.name}", exc)
    print(json.dumps(result, indent=2) if options.json else module.format_table(result))
    return 0


def bench_parser(name: str, module: Any) -> OneLineParser:
    """The options of ``kvmesh bench NAME``: its module's, then --json and --quiet.

    Every option's --help shows its default.
    """
    from kvmesh.common.help_format import DefaultsHelpFormatter, add_common_arguments

    parser = OneLineParser(
        prog=f"kvmesh bench {name}",
        description=BENCHES[name][1],
        formatter_class=DefaultsHelpFormatter,
    )
    module.add_arguments(parser)
    _fleet_defaults(parser)
    add_common_arguments(parser)
    return parser


def _fleet_defaults(parser: argparse.ArgumentParser) -> None:
    """A benchmark's --gateway/--coordinator default to the running fleet (its fleet file)."""
    from kvmesh.cli import fleetfile

    running = fleetfile.find()
    if running is None:
        return
    note = running.note()
    if note:
        print(note, file=sys.stderr)
    fleet = running.data
    nodes = fleet.get("nodes") or [{}]
    found = {"gateway": nodes[0].get("gateway"), "coordinator": fleet.get("coordinator")}
    for action in parser._actions:
        if found.get(action.dest) and action.default is None:
            action.default = found[action.dest]


def run_demo(argv: Sequence[str]) -> int:
    """``kvmesh demo [options]``: torch and the engine are imported only here."""
    from kvmesh.cli import demo

    parser = OneLineParser(prog="kvmesh demo", description=demo.DESCRIPTION)
    demo.add_arguments(parser)
    return demo.run_demo(parser.parse_args(argv))


# Commands that parse their own options (and import heavy modules only when they run).
DEFERRED: dict[str, Callable[[Sequence[str]], int]] = {"bench": run_bench, "demo": run_demo}


def _version() -> str:
    try:
        return importlib.metadata.version("kvmesh")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def build_parser() -> OneLineParser:
    """The whole command line."""
    parser = OneLineParser(
        prog="kvmesh",
        description="kvmesh: a KV-cache layer for LLM inference (gateway, storage, coordinator).",
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for command in SERVICES:
        p = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            epilog=TRACING_HELP,  # the OTEL_* variables every service reads
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_config_arguments(p, command.load(command.config), command.name)
    from kvmesh.cli import up
    from kvmesh.cli.model import add_model_command
    from kvmesh.cli.status import add_status_command
    from kvmesh.cli.traces import add_traces_command

    up.add_up_command(sub)
    add_status_command(sub)
    add_traces_command(sub)
    add_model_command(sub)
    sub.add_parser(
        "demo",
        help="drive a small real transformer through a local fleet: TTFT cold vs warm",
        add_help=False,
    )
    add_bench_command(sub)
    return parser


def _fail(command: str, exc: BaseException) -> int:
    """Print a failed start's one line (exit 2), or re-raise a bug with its traceback."""
    reason = one_line(exc)
    if reason is None:
        raise exc
    print(f"kvmesh {command}: error: {reason}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvmesh`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DEFERRED:
        try:
            return DEFERRED[argv[0]](argv[1:])
        except KeyboardInterrupt:
            return 130
        except Exception as exc:
            return _fail(argv[0], exc)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Named after the command, like its other errors (argparse would say "kvmesh").
        parser.exit(
            2,
            f"kvmesh {args.command}: error: unrecognized arguments: {' '.join(unknown)} "
            f"(see kvmesh {args.command} --help)\n",
        )
    try:
        for command in SERVICES:
            if args.command == command.name:
                flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
                settings = resolve(
                    command.load(command.config), command.name, flags=flags, yaml_path=args.config
                )
                return run_service(command, settings)
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return _fail(args.command, exc)


if __name__ == "__main__":
    sys.exit(main())
