"""``kvmesh SERVICE ARGS`` children forked from an interpreter that imported kvmesh once.

A kvmesh process spends 0.3-0.4 s of CPU importing kvmesh and grpc before it
serves, and a storage node another second importing torch when its first
engine registers; the suite starts about a hundred nodes, coordinators and
gateways, most of whose storage nodes get an engine. :func:`fork_cli` starts the
same ``kvmesh.cli.main.main`` a ``kvmesh`` process runs, with the caller's
arguments, environment and working directory, in a process forked from
multiprocessing's fork server, which imported kvmesh's services once per test
worker. The children are real processes: their own sockets and memory, real
signals, SIGKILL for a crash; only the import is shared.

Tests of what a process does at start (argument errors, exit codes, ``kvmesh
up`` and its reaper, tracing set up from the environment) still exec
``kvmesh`` with :func:`tests.support.harness.spawn_cli`.

Like every multiprocessing child, a forked child first imports the parent's
``__main__`` by name or path (harmless under pytest and its xdist workers,
whose ``__main__`` does nothing on import); a parent reading its script from
stdin cannot use this.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: What the fork server imports before it forks: what a service process imports first,
#: and the copy code (with torch) a storage node loads when an engine registers.
PRELOAD = (
    "kvmesh.cli.main",
    "kvmesh.storage.app",
    "kvmesh.gateway.app",
    "kvmesh.coordinator.app",
    "kvmesh.storage.core.transfer.chunks",
)
_PR_SET_PDEATHSIG = 1


@functools.cache
def _fork_context() -> Any:
    """The worker's fork server context (the server starts with the first child)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def _run_cli(
    argv: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str
) -> None:  # pragma: no cover - runs in the forked child
    # Die with the fork server (it dies with the test worker), as setpriv does for execs.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # The child's own streams on the files; they live until os._exit below.
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.argv = ["kvmesh", *argv]
    # The signal handling of a fresh interpreter (the fork server changed its own).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 1
    try:
        from kvmesh.cli.main import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        # What the interpreter does at exit (span exporters flush in atexit hooks).
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class ForkedProcess:
    """The part of ``subprocess.Popen``'s interface the tests use, for a forked child."""

    def __init__(self, process: Any, log_dir: tempfile.TemporaryDirectory[str]) -> None:
        self._process = process
        self._log_dir = log_dir
        self.pid: int = process.pid
        self.stdout_path = Path(log_dir.name) / "stdout"
        self.stderr_path = Path(log_dir.name) / "stderr"

    @property
    def returncode(self) -> int | None:
        """Exit status; ``-N`` when signal N ended it (as ``Popen``); None while running."""
        code: int | None = self._process.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(["kvmesh", "(forked)"], timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def output(self) -> str:
        """Everything the child wrote so far, stdout then stderr."""
        return "".join(
            path.read_text(errors="replace") if path.exists() else ""
            for path in (self.stdout_path, self.stderr_path)
        )


def fork_cli(
    *args: str, cwd: str | os.PathLike[str], env: Mapping[str, str] | None = None
) -> ForkedProcess:
    """Start ``kvmesh ARGS`` as a child of the fork server; its output goes to two files."""
    log_dir = tempfile.TemporaryDirectory(prefix="kvmesh-test-cli-")
    child_env = dict(os.environ if env is None else env)
    process = _fork_context().Process(
        target=_run_cli,
        args=(
            list(args),
            child_env,
            str(cwd),
            str(Path(log_dir.name) / "stdout"),
            str(Path(log_dir.name) / "stderr"),
        ),
        # Daemonic: a worker that exits with one still running stops it, never waits on it.
        daemon=True,
    )
    process.start()
    return ForkedProcess(process, log_dir)
