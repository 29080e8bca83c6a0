"""What every ``kvmesh <service>`` process does around its app: one error path, one exit path.

* :func:`one_line` turns whatever a start-up raised — a bad setting, an L2
  adapter that cannot be built, an optional package that is not installed,
  a file the process may not create — into the one line the CLI prints
  before it exits with status 2. Anything it does not recognise is a bug and
  keeps its traceback.
* :class:`StartupLogs` holds the log records of the start-up back until the
  server is bound: a start that fails prints its one line and nothing else
  (with ``--log-level DEBUG`` the held records are printed too).
* :func:`reserve_port` picks the port of a ``--port 0`` server before the app
  is built, so the app knows it (a storage node's default instance id is
  ``storage-<hostname>-<port>``).
* :func:`follow_parent` makes a child of ``kvmesh up`` / ``kvmesh demo``
  stop (cleanly, through SIGTERM) when its parent dies, however it died.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import logging.handlers
import os
import signal
import socket
import sys
import threading
from typing import Any

from kvmesh.common.config import ConfigError
from kvmesh.common.errors import KvmeshError

logger = logging.getLogger(__name__)

#: Set by ``kvmesh up`` in its children's environment: the pid they must not outlive.
PARENT_ENV = "KVMESH_PARENT_PID"

# Root package of an optional dependency → (extra that installs it, what needs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "redis": ("redis", 'an L2 adapter of type "redis"'),
    "boto3": ("s3", 'an L2 adapter of type "s3"'),
    "botocore": ("s3", 'an L2 adapter of type "s3"'),
    "nats": ("nats", "NATS (--event-transport nats, --nats-url)"),
    "nixl": ("nixl", 'an L2 adapter of type "nixl"'),
    "nixl_cu12": ("nixl", 'an L2 adapter of type "nixl"'),
    "nixl_cu13": ("nixl", 'an L2 adapter of type "nixl"'),
    "torch": ("storage", "a storage node (kvmesh storage, node, up, demo, bench)"),
    "vllm": ("vllm", "vLLM's connector and kvmesh demo --engine vllm"),
    "gguf": ("models", "kvmesh model get (GGUF weights)"),
    "accelerate": ("models", "kvmesh model get (GGUF weights)"),
    "transformers": ("models", "kvmesh model get"),
}


def missing_extra(exc: ImportError) -> str | None:
    """The one-line reason for an optional package that is not installed (None if not one)."""
    root = (exc.name or "").split(".")[0]
    if root not in EXTRAS:
        return None
    extra, what = EXTRAS[root]
    hint = (
        " (on a host without a GPU, first: pip install torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cpu)"
        if root == "torch"
        else ""
    )
    return (
        f"{what} needs the Python package '{root}', which is not installed: "
        f"pip install 'kvmesh[{extra}]'{hint}"
    )


def one_line(exc: BaseException) -> str | None:
    """The one-line reason of a failed start, or None when ``exc`` is a bug."""
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, ImportError):
        return missing_extra(exc)
    if isinstance(exc, KvmeshError):
        return exc.message
    if isinstance(exc, OSError):
        # A file or directory the process may not create, a full disk, ...
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    return None


class StartupLogs:
    """Holds the root logger's records until :meth:`release` (or drops them at :meth:`drop`)."""

    def __init__(self, show_on_failure: bool = False) -> None:
        root = logging.getLogger()
        self._targets = list(root.handlers)
        self._held = logging.handlers.BufferingHandler(capacity=100_000)
        self._show_on_failure = show_on_failure
        self._done = False
        for handler in self._targets:
            root.removeHandler(handler)
        root.addHandler(self._held)

    def _restore(self, emit: bool) -> None:
        if self._done:
            return
        self._done = True
        root = logging.getLogger()
        root.removeHandler(self._held)
        for handler in self._targets:
            root.addHandler(handler)
            if emit:
                for record in self._held.buffer:
                    if record.levelno >= handler.level:
                        handler.handle(record)
        self._held.close()

    def release(self) -> None:
        """The start succeeded: write what was held, then log as usual."""
        self._restore(emit=True)

    def drop(self) -> None:
        """The start failed: log as usual again; the held records are written only if asked."""
        self._restore(emit=self._show_on_failure)


def reserve_port(settings: Any) -> tuple[Any, socket.socket | None]:
    """For ``--port 0`` (TCP): settings with a port picked now, and the socket that holds it.

    The socket is bound with SO_REUSEADDR but never listens, so the server can
    bind the same port (gRPC sets SO_REUSEADDR too) while no other process is
    handed it; close the socket once the server is bound.
    """
    if getattr(settings, "port", None) != 0 or getattr(settings, "unix_socket", ""):
        return settings, None
    host = settings.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:0: {exc.strerror or exc}") from exc
    return dataclasses.replace(settings, port=sock.getsockname()[1]), sock


_PR_SET_PDEATHSIG = 1


def follow_parent(environ: dict[str, str] | None = None) -> None:
    """Stop this process (SIGTERM to itself) when the parent named by $KVMESH_PARENT_PID dies.

    Two ways, so neither a SIGKILL of the parent nor a kernel without prctl
    leaves the child running under PID 1: the kernel's parent-death signal
    (``prctl(PR_SET_PDEATHSIG)``) and a thread that checks the parent once a
    second. SIGTERM runs the service's normal clean shutdown.
    """
    env = os.environ if environ is None else environ
    text = env.get(PARENT_ENV, "")
    if not text:
        return
    try:
        parent = int(text)
    except ValueError:
        raise ConfigError(f"{PARENT_ENV}: {text!r} is not a process id") from None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            logger.debug("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent watch")
    if os.getppid() != parent:  # the parent died before the prctl took effect
        raise ConfigError(f"the parent process {parent} is gone; not starting")

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(1.0):
            if os.getppid() != parent:
                logger.warning("parent process %d is gone; stopping", parent)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="kvmesh-parent-watch", daemon=True).start()
