"""Coordinator commands on the node: the one executor every transport uses, and the handler call.

Commands arrive where acks arrive (the gRPC stream's reader thread, the NATS
client's event loop) and must not run there: a slow delete would stall the
acks behind it. Every session therefore hands each wire command to its
:class:`CommandExecutor`, which converts it, runs it through the emitter
(:meth:`SessionListener.on_command
<kvmesh.storage.events.transport.SessionListener.on_command>`) one at a time
in arrival order, and passes the result to the session's ``reply``. Its
worker thread exists only while commands are queued or running, so an idle
session runs no command thread.

:func:`run_handler` is the emitter's half: the node's
:class:`~kvmesh.storage.core.ports.CommandHandler` called, a failure turned
into a status code.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.errors import KvmeshError
from kvmesh.storage.core.ports import CommandHandler, NodeCommand
from kvmesh.storage.events.codec import command_from_proto
from kvmesh.storage.events.transport import CommandResult, SessionListener

logger = logging.getLogger(__name__)

__all__ = ["CommandExecutor", "run_command", "run_handler"]


def run_handler(handler: CommandHandler | None, command: NodeCommand) -> tuple[str, str, int]:
    """Run ``command`` through ``handler``: ``(code, message, affected)``; never raises.

    No handler is UNIMPLEMENTED; a :class:`KvmeshError` keeps its code; any
    other exception is INTERNAL (and logged with its traceback).
    """
    if handler is None:
        return "UNIMPLEMENTED", "this node does not accept coordinator commands", 0
    try:
        return "OK", "", int(handler.handle_command(command))
    except KvmeshError as exc:
        return exc.code, exc.message, 0
    except Exception as exc:
        logger.exception("command %s (%s) failed", command.command_id, type(command).__name__)
        return "INTERNAL", f"{type(exc).__name__}: {exc}", 0


def run_command(listener: SessionListener, msg: ingest_pb2.NodeCommand) -> CommandResult:
    """Run one wire command through the emitter's listener; always returns a result.

    A command that does not convert is answered with its error code; a
    listener that raises (it must not) is answered INTERNAL, so the
    coordinator always hears back, whichever transport carried the command.
    """
    try:
        command = command_from_proto(msg)
    except KvmeshError as exc:
        logger.warning("rejecting command %s: %s", msg.command_id, exc.message)
        return CommandResult(command_id=msg.command_id, code=exc.code, message=exc.message)
    try:
        return listener.on_command(command)
    except Exception as exc:
        logger.exception("on_command failed for %s", msg.command_id)
        return CommandResult(
            command_id=msg.command_id, code="INTERNAL", message=f"{type(exc).__name__}: {exc}"
        )


class CommandExecutor:
    """Runs one session's commands in arrival order, one at a time, off the ack path.

    :meth:`submit` never blocks: it queues the wire command and starts a
    worker thread (named ``name``) when none is running; the worker runs
    :func:`run_command` and hands each result to ``reply`` (on the worker;
    ``reply`` may block for a bounded time, e.g. to publish it), and ends as
    soon as the queue is empty. :meth:`close` drops what is queued (its
    results could no longer reach the coordinator); a command already
    running finishes. Thread-safe.
    """

    def __init__(
        self, listener: SessionListener, reply: Callable[[CommandResult], None], *, name: str
    ) -> None:
        self._listener = listener
        self._reply = reply
        self._name = name
        self._lock = threading.Lock()
        self._queue: deque[ingest_pb2.NodeCommand] = deque()
        self._running = False
        self._closed = False
        # Every worker started and maybe not ended yet, for join().
        self._workers: list[threading.Thread] = []

    def submit(self, msg: ingest_pb2.NodeCommand) -> bool:
        """Queue ``msg`` for execution; False (not queued) once closed."""
        with self._lock:
            if self._closed:
                return False
            self._queue.append(msg)
            if self._running:
                return True
            self._running = True
            self._workers = [t for t in self._workers if t.is_alive()]
            worker = threading.Thread(target=self._drain, name=self._name, daemon=True)
            self._workers.append(worker)
            # Started under the lock so that join() never misses it.
            worker.start()
        return True

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                msg = self._queue.popleft()
            result = run_command(self._listener, msg)
            try:
                self._reply(result)
            except Exception:
                logger.exception("answering command %s failed", result.command_id)

    def close(self) -> None:
        """Stop accepting commands and drop the queued ones; idempotent, never blocks."""
        with self._lock:
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
        if dropped:
            logger.info("event stream ended; not running %d queued commands", dropped)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to end; True when no worker is left (or none ever ran)."""
        me = threading.current_thread()
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            if worker is not me:
                worker.join(timeout)
        return not any(w.is_alive() for w in workers)
