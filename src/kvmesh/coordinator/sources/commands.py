"""Commands to nodes over NATS, and the results they publish back.

Commands go to ``kvmesh.commands.<instance>`` over core NATS, best effort:
the node reports the effects as DELETE events in the stream, and a node not
subscribed right now never sees the command. Results come back on
``kvmesh.command_results.<instance>`` and go to ``on_command_result``.
:class:`NatsCommands` is the core's ``DeleteDispatcher`` for NATS nodes; it
publishes over whichever connection the source's session holds
(:meth:`NatsCommands.attach`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Sequence

from google.protobuf.message import DecodeError
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.common.nats_names import (
    COMMAND_RESULTS_ROOT,
    commands_subject,
    instance_from_token,
    nats_error_text,
)
from kvmesh.coordinator.wire import delete_command, resync_commands

logger = logging.getLogger(__name__)

#: Where nodes publish command results (one subject per instance below it).
RESULTS_SUBJECTS = f"{COMMAND_RESULTS_ROOT}.*"


class NatsCommands:
    """Publishes node commands on the current connection; counts them and their results.

    ``on_command_result`` receives ``(instance_id, CommandResult)`` for every
    result a node publishes (on the loop thread; keep it quick);
    ``on_command_sent`` receives ``(instance_id, NodeCommand)`` for every
    command published (on the caller's thread).
    """

    def __init__(
        self,
        on_command_result: Callable[[str, ingest_pb2.CommandResult], None] | None = None,
        on_command_sent: Callable[[str, ingest_pb2.NodeCommand], None] | None = None,
    ) -> None:
        self._on_command_result = on_command_result
        self._on_command_sent = on_command_sent
        self._nc: NatsClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._sent = 0
        self._results = 0

    def attach(self, nc: NatsClient | None, loop: asyncio.AbstractEventLoop | None) -> None:
        """Publish over ``nc`` on ``loop`` from now on (None: no connection)."""
        self._nc, self._loop = nc, loop

    @property
    def sent(self) -> int:
        """Commands published so far."""
        with self._lock:
            return self._sent

    @property
    def results(self) -> int:
        """Command results received so far."""
        with self._lock:
            return self._results

    def send_command(self, instance_id: str, command: ingest_pb2.NodeCommand) -> bool:
        """Publish ``command`` to the node (any thread, never blocks); False when not connected.

        A missing ``command_id`` is filled in.
        """
        nc, loop = self._nc, self._loop
        if nc is None or loop is None or not nc.is_connected:
            return False
        if not command.command_id:
            command.command_id = f"nats-cmd-{next(self._ids)}"
        coro = _publish(nc, commands_subject(instance_id), command.SerializeToString())
        try:
            asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            return False
        with self._lock:
            self._sent += 1
        on_sent = self._on_command_sent
        if on_sent is not None:
            try:
                on_sent(instance_id, command)
            except Exception:
                logger.exception("recording command %s failed", command.command_id)
        return True

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> str:
        """The core's ``DeleteDispatcher`` over NATS: a ``DeleteKeysCommand``; its id."""
        command = delete_command(tier, backend, keys, force)
        return command.command_id if self.send_command(instance_id, command) else ""

    def dispatch_resync(self, instance_id: str) -> bool:
        """The core's ``ResyncDispatcher`` over NATS: a ``ResyncCommand`` per tier."""
        sent = [self.send_command(instance_id, c) for c in resync_commands()]
        return all(sent)

    async def on_result(self, msg: Msg) -> None:
        """Subscription callback for :data:`RESULTS_SUBJECTS`."""
        token = msg.subject[len(COMMAND_RESULTS_ROOT) + 1 :]
        try:
            instance_id = instance_from_token(token)
            result = ingest_pb2.CommandResult.FromString(msg.data)
        except (DecodeError, UnicodeDecodeError, ValueError):
            logger.warning("ignoring an undecodable command result on %s", msg.subject)
            return
        with self._lock:
            self._results += 1
        callback = self._on_command_result
        if callback is None:
            return
        try:
            callback(instance_id, result)
        except Exception:
            logger.exception("handling the result of command %s failed", result.command_id)


async def _publish(nc: NatsClient, subject: str, payload: bytes) -> None:
    try:
        await nc.publish(subject, payload)
    except Exception as exc:
        logger.warning("publishing to %s failed: %s", subject, nats_error_text(exc))
