"""Pieces the benchmarks share."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO, TypeVar

from kvmesh.common.help_format import DefaultsHelpFormatter, add_common_arguments
from kvmesh.common.sigterm import sigterm_held
from kvmesh.common.thread_priority import MAX_REALTIME_PRIORITY

__all__ = [
    "DefaultsHelpFormatter",
    "LoopThread",
    "Progress",
    "ServiceProcess",
    "add_common_arguments",
    "bench_main",
    "cpu_seconds",
    "free_port",
    "size_text",
    "start_service",
]

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on its own thread, for servers and clients a benchmark runs in-process."""

    def __init__(self, name: str = "kvmesh-bench-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600.0) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and join its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


#: Seconds a benchmark may go without a progress line: a longer phase repeats itself.
HEARTBEAT_S = 3.0


class Progress:
    """Progress lines of a running benchmark on stderr, ``NAME: what it does now``.

    stdout stays the result alone (the table or the JSON object). :meth:`phase`
    names what runs now and prints it; while a phase lasts, a heartbeat thread
    repeats it every ``every_s`` seconds with the seconds it has taken and, where
    :meth:`count` was called, how far it got (``lookup: [node] timed lookups
    + EndSession ... 1216/2000 done, 3 s``), so a long phase still prints a
    line every few seconds. :meth:`say` prints a line without changing the phase. With
    ``quiet`` nothing is printed. Use it as a context manager: entering starts
    the heartbeat, leaving stops it (and says how long the run took).
    """

    def __init__(
        self,
        name: str,
        *,
        quiet: bool = False,
        every_s: float = HEARTBEAT_S,
        stream: TextIO | None = None,
    ) -> None:
        self.name = name
        self.quiet = quiet
        self.every_s = every_s
        self._stream = stream
        self._lock = threading.Lock()
        self._phase = ""
        self._started = self._phase_started = self._last = time.monotonic()
        self._done: int | None = None
        self._total: int | None = None
        self._unit = "done"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_args(cls, name: str, args: argparse.Namespace) -> Progress:
        """The progress of benchmark ``name``, silent when its options say ``--quiet``."""
        return cls(name, quiet=bool(getattr(args, "quiet", False)))

    def say(self, text: str) -> None:
        """Print ``NAME: text`` now."""
        if self.quiet:
            return
        with self._lock:
            self._write(text)

    def phase(self, text: str, total: int | None = None, unit: str = "done") -> None:
        """Start a phase and print it.

        ``total``: the steps it has, which :meth:`count` counts and the heartbeat
        shows as ``done/total unit``.
        """
        with self._lock:
            self._phase = text
            self._phase_started = time.monotonic()
            self._done = 0 if total is not None else None
            self._total = total
            self._unit = unit
            if not self.quiet:
                self._write(text)

    def count(self, done: int) -> None:
        """Steps of the current phase done so far (cheap: the heartbeat prints it)."""
        self._done = done

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if not self.quiet and self.every_s > 0:
            self._thread = threading.Thread(
                target=self._beat, name=f"kvmesh-bench-{self.name}-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        seconds = time.monotonic() - self._started
        self.say(
            f"done in {seconds:.1f} s" if exc_type is None else f"failed after {seconds:.1f} s"
        )

    def _beat(self) -> None:
        while not self._stop.wait(min(0.25, self.every_s)):
            with self._lock:
                now = time.monotonic()
                if not self._phase or now - self._last < self.every_s:
                    continue
                done = "" if self._done is None else f"{self._done}/{self._total} {self._unit}, "
                self._write(f"{self._phase} ... {done}{now - self._phase_started:.0f} s")

    def _write(self, text: str) -> None:
        # Called with the lock held.
        stream = self._stream or sys.stderr
        stream.write(f"{self.name}: {text}\n")
        stream.flush()
        self._last = time.monotonic()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (for a server the benchmark starts)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far, all threads (Linux)."""
    with open(f"/proc/{pid}/stat") as fh:
        # The command name may hold spaces: fields count from the closing parenthesis.
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def size_text(nbytes: float) -> str:
    """``nbytes`` for a progress line: ``32 MiB``, ``1.5 GiB``, ``512 B``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            break
        nbytes /= 1024
    return f"{nbytes:.0f} {unit}" if float(nbytes).is_integer() else f"{nbytes:.1f} {unit}"


def bench_main(
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    format_table: Callable[[dict[str, Any]], str],
    argv: list[str] | None = None,
) -> None:
    """``python -m kvmesh.bench.<name> [--json]``: the same options as ``kvmesh bench <name>``."""
    parser = argparse.ArgumentParser(
        description=(doc or "").splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    add_arguments(parser)
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_table(result))


def add_connector_option_argument(parser: argparse.ArgumentParser) -> None:
    """``--connector-option KEY=VALUE`` (repeatable): kv_connector_extra_config of kvmesh's
    arrangements; read them with :func:`connector_options`."""
    parser.add_argument(
        "--connector-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a kv_connector_extra_config key for the kvmesh arrangements (repeatable), "
        "e.g. load_by_layer=false",
    )


def add_node_realtime_argument(parser: argparse.ArgumentParser) -> None:
    """``--node-realtime-priority N``: the benchmark's own node runs its event loop and copy
    threads under SCHED_FIFO (``kvmesh node --realtime-priority``)."""
    parser.add_argument(
        "--node-realtime-priority",
        type=_realtime_priority,
        default=0,
        metavar="N",
        help="run the benchmark's kvmesh node with --realtime-priority N (SCHED_FIFO for its "
        "event loop and copy threads; needs CAP_SYS_NICE; 0 = the default policy)",
    )


def _realtime_priority(text: str) -> int:
    """argparse type of ``--node-realtime-priority``: 0..99."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= MAX_REALTIME_PRIORITY:
        raise argparse.ArgumentTypeError(f"{value} is not 0 (off) or 1..{MAX_REALTIME_PRIORITY}")
    return value


def node_realtime_args(priority: int) -> list[str]:
    """The ``kvmesh node`` options for ``--node-realtime-priority`` (none for 0)."""
    return ["--realtime-priority", str(priority)] if priority else []


def connector_options(pairs: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs as a dict; SystemExit naming a pair without ``=``."""
    options = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise SystemExit(f"--connector-option {pair!r}: expected KEY=VALUE")
        options[key] = value
    return options


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``--model NAME|DIR`` of the benchmarks that run real vLLM."""
    parser.add_argument(
        "--model",
        metavar="NAME|DIR",
        default=None,
        help="a Hugging Face model directory, or a model kvmesh makes offline (smollm2: "
        "SmolLM2-135M-Instruct, see kvmesh model) (default: a tiny random-weight Llama made "
        "in a temporary directory)",
    )


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of sorted, non-empty ``ordered``."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def start_service(
    owned: list[ServiceProcess], service: str, args: list[str], workdir: Path, name: str
) -> ServiceProcess:
    """Start ``kvmesh SERVICE ARGS`` and append it to ``owned``, the list the caller's
    finally block stops, with SIGTERM held off from the fork until the append."""
    with sigterm_held():
        proc = ServiceProcess(service, args, workdir, name)
        owned.append(proc)
    return proc


@contextmanager
def service_deaths_named(owned: Sequence[ServiceProcess]) -> Iterator[None]:
    """Re-raise a failure inside the block as one that names each service of ``owned``
    that has exited, with its status and the end of its log.

    A service that died shows up first as a refused connection or an RPC error
    in the benchmark; its log (in a work folder the benchmark removes) says why.
    """
    try:
        yield
    except Exception as exc:
        reports = [r for r in (proc.exit_report() for proc in owned) if r is not None]
        if not reports:
            raise
        raise RuntimeError(f"{exc}\n" + "\n".join(reports)) from exc


class ServiceProcess:
    """A kvmesh service (``kvmesh <service> ...``) run as a subprocess for a benchmark.

    Its log goes to ``workdir/NAME.log``; :meth:`wait_ready` returns the
    endpoints of its ready file (``grpc``: its address).
    """

    def __init__(self, service: str, args: list[str], workdir: Path, name: str) -> None:
        self.ready = workdir / f"{name}.ready.json"
        self.log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", service, *args, "--ready-file", str(self.ready)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.endpoints: dict[str, Any] = {}

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log.name}: exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.log.name}: not ready after {timeout} s")
            time.sleep(0.05)
        self.endpoints = json.loads(self.ready.read_text())
        return self.endpoints

    def exit_report(self, chars: int = 3000) -> str | None:
        """None while it runs; once it has exited, its status and the end of its log."""
        status = self.proc.poll()
        if status is None:
            return None
        try:
            tail = Path(self.log.name).read_text(errors="replace")[-chars:]
        except OSError as exc:
            tail = f"(its log cannot be read: {exc})"
        return f"{self.log.name}: exited with {status}; its log ends:\n{tail}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
